#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The control plane harness itself: it answers as a real API server does (RBAC enforced
//! per identity, namespaces deleted by the namespace controller), and it leaves nothing
//! behind: a dropped plane stops its daemons and removes its directory, and so does the
//! plane of a test process that was killed (its watchdog notices).

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::harness::ControlPlane;

/// Hang guard of the waits below: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(120);

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s.get(i + 2..i + 3))
                .map(|c| c != "Z")
        })
        .unwrap_or(false)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < GUARD,
            "{what}: not within {GUARD:?} (hang guard)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_is_enforced_per_identity_and_namespaces_go_away() {
    let plane = ControlPlane::shared().unwrap();
    plane.install_crds().await.unwrap();
    plane.install_rbac().unwrap();
    let ns = plane.namespace("cp-rbac").await.unwrap();

    // A ServiceAccount with no role: every read is refused.
    plane
        .kubectl_run(&["create", "serviceaccount", "nobody", "-n", ns.name()])
        .unwrap();
    let nobody = plane
        .service_account_kubeconfig(ns.name(), "nobody")
        .unwrap();
    let out = Command::new(plane.kubectl_path())
        .env("KUBECONFIG", &nobody)
        .args(["get", "secrets", "-n", ns.name()])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a ServiceAccount without a role listed Secrets"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Forbidden") || err.contains("forbidden"),
        "{err}"
    );

    // The operator's account: what config/rbac grants, and not more.
    let operator = plane.operator_kubeconfig().unwrap();
    let can = |verb: &str, resource: &str| {
        let (resource, sub) = resource.split_once('/').unwrap_or((resource, ""));
        let out = Command::new(plane.kubectl_path())
            .env("KUBECONFIG", &operator)
            .args(["auth", "can-i", verb, resource, "--all-namespaces"])
            .arg(format!("--subresource={sub}"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    assert!(can("watch", "proxies.egress-operator.dev"));
    assert!(can("patch", "proxies.egress-operator.dev/status"));
    assert!(
        !can("list", "secrets"),
        "the operator may list every Secret"
    );
    assert!(!can("delete", "namespaces"));

    // The namespace controller runs: a deleted namespace goes away.
    let name = ns.name().to_string();
    drop(ns);
    wait_until(&format!("namespace {name} gone"), || {
        let out = plane
            .kubectl()
            .args([
                "get",
                "namespace",
                &name,
                "--ignore-not-found",
                "-o",
                "name",
            ])
            .output()
            .unwrap();
        out.status.success() && out.stdout.is_empty()
    });
}

#[test]
fn a_dropped_plane_leaves_no_process_and_no_directory() {
    let plane = ControlPlane::start().unwrap();
    if !plane.is_local() {
        println!("KUBECONFIG names an external cluster: nothing was started, nothing to check");
        return;
    }
    let dir = plane.dir().unwrap().to_path_buf();
    let pids = plane.pids();
    assert_eq!(
        pids.len(),
        3,
        "etcd, kube-apiserver, kube-controller-manager: {pids:?}"
    );
    plane.restart_apiserver().unwrap();
    let out = plane.kubectl_run(&["get", "--raw=/readyz"]).unwrap();
    assert_eq!(out.trim(), "ok");
    let pids = plane.pids();
    drop(plane);
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived its plane");
    }
    assert!(!dir.exists(), "{} outlived its plane", dir.display());
}

/// Not a test of its own: the child process of the next test, which starts a plane,
/// prints where it is, and waits to be killed.
#[test]
#[ignore = "run by a_killed_test_process_leaves_nothing_behind"]
fn plane_holder() {
    if std::env::var_os("EGRESS_PLANE_HOLDER").is_none() {
        return;
    }
    let plane = ControlPlane::start().unwrap();
    let pids: Vec<String> = plane.pids().iter().map(u32::to_string).collect();
    println!(
        "PLANE {} {}",
        plane.dir().unwrap().display(),
        pids.join(" ")
    );
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_killed_test_process_leaves_nothing_behind() {
    if !ControlPlane::shared().unwrap().is_local() {
        println!("KUBECONFIG names an external cluster: nothing is started, nothing to check");
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["plane_holder", "--exact", "--ignored", "--nocapture"])
        .env("EGRESS_PLANE_HOLDER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("PLANE "))
        .expect("the child printed where its plane is");
    let mut words = line.split_whitespace().skip(1);
    let dir = PathBuf::from(words.next().unwrap());
    let pids: Vec<u32> = words.map(|w| w.parse().unwrap()).collect();
    assert_eq!(pids.len(), 3, "{line}");
    assert!(dir.exists());
    // As a crash or a CI time-out would end it: no drop runs.
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until("the killed process's daemons gone", || {
        pids.iter().all(|p| !alive(*p))
    });
    wait_until("the killed process's directory gone", || !dir.exists());
}
