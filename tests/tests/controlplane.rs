#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The control plane harness itself: it answers as a real API server does (RBAC enforced
//! per identity, namespaces deleted by the namespace controller), and it leaves nothing
//! behind: a dropped plane stops its daemons and removes its directory, and so does the
//! plane of a test process that was killed (its watchdog notices), also when the next test
//! binary's stale sweep removed its directory first.

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

/// A stand-in test binary holding the shared plane (`src/bin/plane-holder.rs`), with what
/// it printed about its plane: the directory and the daemons' PIDs.
struct Holder {
    child: std::process::Child,
    dir: PathBuf,
    pids: Vec<u32>,
}

impl Holder {
    fn start() -> Holder {
        let mut child = Command::new(env!("CARGO_BIN_EXE_plane-holder"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let line = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("PLANE "))
            .expect("the holder printed where its plane is");
        let mut words = line.split_whitespace().skip(1);
        let dir = PathBuf::from(words.next().unwrap());
        let pids: Vec<u32> = words.map(|w| w.parse().unwrap()).collect();
        assert_eq!(pids.len(), 3, "{line}");
        assert!(dir.exists());
        Holder { child, dir, pids }
    }

    /// Ends as a test binary does when its tests are done: the process exits, no drop.
    fn exit(mut self) -> (PathBuf, Vec<u32>) {
        drop(self.child.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "plane-holder: {status}");
        (self.dir, self.pids)
    }

    /// The holder's watchdog: `bash -c SCRIPT watchdog <holder pid> ...`.
    fn watchdog(&self) -> u32 {
        let owner = self.child.id().to_string();
        let found: Vec<u32> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let args = cmdline(*pid);
                args.windows(2).any(|w| w[0] == "watchdog" && w[1] == owner)
            })
            .collect();
        assert_eq!(found.len(), 1, "one watchdog for plane-holder {owner}");
        found[0]
    }
}

fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn signal(pid: u32, name: &str) {
    let st = Command::new("kill")
        .args(["-s", name, &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -s {name} {pid}");
}

/// Daemons of a plane that must be gone, SIGKILLed on drop if a failed assertion left
/// them running (only while their command line still names the plane's directory, so a
/// reused PID is never hit); its frozen watchdog is let go on drop too.
struct Leaked {
    dir: PathBuf,
    pids: Vec<u32>,
    watchdog: u32,
}

impl Leaked {
    fn alive(&self) -> Vec<u32> {
        let inside = format!("{}/", self.dir.display());
        self.pids
            .iter()
            .copied()
            .filter(|&p| alive(p) && cmdline(p).iter().any(|a| a.contains(&inside)))
            .collect()
    }
}

impl Drop for Leaked {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.watchdog.to_string()])
            .status();
        for pid in self.alive() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// Issue 33, item 14: a test binary ends; before its watchdog's next poll the next test
/// binary's stale sweep removes its plane's directory; the watchdog took the missing
/// directory for an orderly stop and left kube-apiserver and etcd running for good. The
/// race is made certain by freezing the first binary's watchdog (SIGSTOP) across the
/// window, then letting it go on (SIGCONT).
///
/// - Back to back: the second binary's sweep must kill the first one's daemons itself
///   (they die while the first watchdog is still frozen); before the fix it only removed
///   the directory, and the daemons outlived everything.
/// - The watchdog alone: a directory that vanished after its owner ended (any sweep, an
///   older harness's included) must still end in killed daemons; before the fix the
///   watchdog exited at once, killing nothing.
#[test]
fn back_to_back_test_binaries_leave_no_daemon_behind() {
    if !ControlPlane::shared().unwrap().is_local() {
        println!("KUBECONFIG names an external cluster: nothing is started, nothing to check");
        return;
    }
    // Back to back: the first ends, its watchdog frozen; the second starts (and sweeps).
    let first = Holder::start();
    let watchdog = first.watchdog();
    signal(watchdog, "STOP");
    let (dir, pids) = first.exit();
    let first = Leaked {
        dir,
        pids,
        watchdog,
    };
    let second = Holder::start();
    assert!(
        !first.dir.exists(),
        "the second binary's sweep removed the first's plane"
    );
    wait_until(
        "the first binary's daemons killed by the second's sweep",
        || first.alive().is_empty(),
    );
    signal(watchdog, "CONT");
    wait_until("the first binary's watchdog gone", || !alive(watchdog));

    // The watchdog alone: the directory goes between the owner's end and its next poll.
    let watchdog = second.watchdog();
    signal(watchdog, "STOP");
    let (dir, pids) = second.exit();
    let second = Leaked {
        dir,
        pids,
        watchdog,
    };
    std::fs::remove_dir_all(&second.dir).unwrap();
    signal(watchdog, "CONT");
    wait_until("the watchdog killed the daemons of a removed plane", || {
        second.alive().is_empty()
    });
    wait_until("the second binary's watchdog gone", || !alive(watchdog));
}

#[test]
fn a_killed_test_process_leaves_nothing_behind() {
    if !ControlPlane::shared().unwrap().is_local() {
        println!("KUBECONFIG names an external cluster: nothing is started, nothing to check");
        return;
    }
    let Holder {
        mut child,
        dir,
        pids,
    } = Holder::start();
    // As a crash or a CI time-out would end it: no drop runs.
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until("the killed process's daemons gone", || {
        pids.iter().all(|p| !alive(*p))
    });
    wait_until("the killed process's directory gone", || !dir.exists());
}
