#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Leader election between real replica processes (`egress-operator run`, each acting as
//! the operator's ServiceAccount with `config/rbac` as shipped) on the local control plane.
//!
//! - Three replicas: exactly one leads. The holder is killed with SIGKILL; another takes
//!   over once the Lease expires. The new holder gets SIGTERM; it releases the Lease and
//!   the last one takes over within its retry period. Each replica's fence (its `/readyz`:
//!   `ready: leading`) is sampled every 50 ms all along: at no sample do two replicas lead.
//! - A Lease name the Role does not cover fails loudly at start: the process exits
//!   non-zero naming the Lease, instead of standing by forever.
//!
//! Times are printed, never asserted (hang guards only).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration_tests::harness::ControlPlane;
use integration_tests::harness::controlplane::OPERATOR_NAMESPACE;
use integration_tests::operator_process::{OperatorOptions, OperatorProcess};

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(120);

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

/// A valid providers config whose one host is a closed loopback port: the replicas elect,
/// reconcile no Proxy, and the health monitor reports the host unreachable.
fn write_config(dir: &Path) -> PathBuf {
    let key = dir.join("id_ed25519");
    let st = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(st.success());
    let known = dir.join("known_hosts");
    std::fs::write(&known, "").unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap();
    drop(closed);
    let domain = integration_tests::plugin_path("domain-default").unwrap();
    let vendor = integration_tests::plugin_path("vendor-data-default").unwrap();
    let yaml = format!(
        r#"clusterId: leader-test
kvm2:
  ssh:
    user: egress
    privateKeyFile: {key}
    knownHostsFile: {known}
    connectTimeoutSeconds: 2
  hosts:
    - {{name: h1, address: "{dead}", storagePool: default, bridge: br0}}
  images:
    - {{name: img, url: "https://images.invalid/img.qcow2", sha256: "{sha}", format: qcow2}}
  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 256, diskGiB: 1, firmware: bios}}
  defaults: {{machineType: small, image: img}}
  templates:
    domain: {{path: {domain}}}
    vendorData: {{path: {vendor}}}
healthCheck: {{periodSeconds: 30, timeoutSeconds: 2}}
"#,
        key = key.display(),
        known = known.display(),
        sha = "ab".repeat(32),
        domain = domain.display(),
        vendor = vendor.display(),
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn leading(op: &OperatorProcess) -> bool {
    matches!(op.http_get("/readyz"), Some((200, body)) if body.contains("leading"))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < GUARD,
            "{what}: not within {GUARD:?} (hang guard)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

#[test]
fn replicas_never_lead_together_through_a_crash_and_a_handover() {
    let plane = ControlPlane::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(plane.install_crds()).unwrap();
    plane.install_rbac().unwrap();
    let kubeconfig = plane.operator_kubeconfig().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path());

    let replicas: Arc<Mutex<Vec<Option<OperatorProcess>>>> = Arc::new(Mutex::new(
        (0..3)
            .map(|i| {
                let options = OperatorOptions::new(
                    &binary(),
                    &config,
                    &kubeconfig,
                    &format!("replica-{i}"),
                    OPERATOR_NAMESPACE,
                    dir.path(),
                );
                Some(OperatorProcess::start(&options).unwrap())
            })
            .collect(),
    ));

    // The fence of every live replica, sampled all along.
    let stop = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (replicas, stop, most, samples) = (
            replicas.clone(),
            stop.clone(),
            most.clone(),
            samples.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let now = {
                    let guard = replicas.lock().unwrap();
                    guard.iter().flatten().filter(|op| leading(op)).count()
                };
                most.fetch_max(now, Ordering::SeqCst);
                samples.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let holder = || -> Option<usize> {
        let guard = replicas.lock().unwrap();
        guard
            .iter()
            .enumerate()
            .find(|(_, op)| op.as_ref().is_some_and(leading))
            .map(|(i, _)| i)
    };
    let lease_holder = || {
        plane
            .kubectl_run(&[
                "get",
                "lease",
                "egress-operator",
                "-n",
                OPERATOR_NAMESPACE,
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])
            .unwrap_or_default()
    };

    let took = wait_for("a first leader", || holder().is_some());
    let first = holder().unwrap();
    assert_eq!(lease_holder(), format!("replica-{first}"));
    println!("replica-{first} leads after {:.1} s", took.as_secs_f64());

    // SIGKILL: no release; another takes over once the Lease expires.
    let killed_at = Instant::now();
    replicas.lock().unwrap()[first]
        .take()
        .unwrap()
        .kill()
        .unwrap();
    wait_for("a leader after the SIGKILL", || holder().is_some());
    let second = holder().unwrap();
    assert_ne!(second, first);
    assert_eq!(lease_holder(), format!("replica-{second}"));
    println!(
        "replica-{first} killed (SIGKILL); replica-{second} leads {:.1} s later (lease expiry)",
        killed_at.elapsed().as_secs_f64()
    );

    // SIGTERM: the holder releases; the last one takes over within its retry period.
    let termed_at = Instant::now();
    let mut stopping = replicas.lock().unwrap()[second].take().unwrap();
    let status = stopping.terminate().unwrap();
    assert!(
        status.success(),
        "SIGTERM: exit {status}; it logged:\n{}",
        stopping.log()
    );
    wait_for("a leader after the SIGTERM", || holder().is_some());
    let third = holder().unwrap();
    assert!(third != first && third != second);
    println!(
        "replica-{second} stopped (SIGTERM, lease released); replica-{third} leads {:.1} s later",
        termed_at.elapsed().as_secs_f64()
    );

    stop.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let most = most.load(Ordering::SeqCst);
    println!(
        "{} samples of every replica's fence; at most {most} leading at once",
        samples.load(Ordering::SeqCst)
    );
    assert_eq!(most, 1, "two replicas led at the same time");
}

/// Issue 19, finding 6, in the process: a leader whose Lease is taken from it (another
/// holder written over its hold) stands down, and before it stands by it cuts itself off
/// its hosts and says so: its log says no call of its still runs, and `/metrics`
/// exports what the cut found. Once the other hold expires it leads again (reconnected).
#[test]
fn a_deposed_leader_cuts_itself_off_its_hosts_and_leads_again_later() {
    let plane = ControlPlane::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(plane.install_crds()).unwrap();
    plane.install_rbac().unwrap();
    let kubeconfig = plane.operator_kubeconfig().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path());
    let options = OperatorOptions::new(
        &binary(),
        &config,
        &kubeconfig,
        "replica-0",
        OPERATOR_NAMESPACE,
        dir.path(),
    );
    let op = OperatorProcess::start(&options).unwrap();
    wait_for("the replica to lead", || leading(&op));

    // Someone else's fresh hold over ours: our next renewal finds it and stands down.
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.000000Z")
        .to_string();
    let patch = format!(r#"{{"spec":{{"holderIdentity":"intruder","renewTime":"{now}"}}}}"#);
    plane
        .kubectl_run(&[
            "patch",
            "lease",
            "egress-operator",
            "-n",
            OPERATOR_NAMESPACE,
            "--type",
            "merge",
            "-p",
            &patch,
        ])
        .unwrap();
    wait_for("the replica to stand down", || !leading(&op));
    wait_for("the cut to be logged", || {
        op.log()
            .contains("cut off the provider's targets; no call of ours still runs")
    });
    let metrics = op.http_get("/metrics").map(|(_, b)| b).unwrap_or_default();
    assert!(
        metrics.contains(r#"egress_fence_calls_still_running{provider="kvm2"} 0"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"egress_fence_severed_calls_total{provider="kvm2"}"#),
        "{metrics}"
    );

    // The intruder never renews: once its hold expires the replica leads again.
    wait_for("the replica to lead again", || leading(&op));
    println!("deposed, cut off and leading again; log:\n{}", op.log());
}

#[test]
fn a_lease_the_role_does_not_cover_fails_loudly_at_start() {
    let plane = ControlPlane::shared().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(plane.install_crds()).unwrap();
    plane.install_rbac().unwrap();
    let kubeconfig = plane.operator_kubeconfig().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path());
    let mut options = OperatorOptions::new(
        &binary(),
        &config,
        &kubeconfig,
        "replica-uncovered",
        OPERATOR_NAMESPACE,
        dir.path(),
    );
    options.extra_args = vec!["--lease-name".into(), "not-covered-by-the-role".into()];
    let mut op = OperatorProcess::start(&options).unwrap();
    wait_for("the replica to exit", || op.exited().is_some());
    let status = op.exited().unwrap();
    assert!(!status.success(), "it exited 0; it logged:\n{}", op.log());
    let log = op.log();
    assert!(
        log.contains("not-covered-by-the-role")
            && (log.contains("forbidden") || log.contains("403")),
        "the exit does not name the Lease and the refusal:\n{log}"
    );
    println!("exit {status}: {}", log.lines().last().unwrap_or_default());
}
