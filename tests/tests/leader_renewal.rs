#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! A leader that does not flinch (issue 33, item 3), with real replica processes
//! (`egress-operator run` as the operator's ServiceAccount) on the local control plane:
//!
//! - `kubectl annotate` of the Lease between the leader's read and its write (a 409 on
//!   the renewal) does not depose it;
//! - transient failures of the Lease requests (500, a dropped connection, 429, 503) for
//!   3 s, well within the 10 s renew deadline, do not depose it;
//! - a holder that stopped renewing is taken over once its lease duration has passed, even
//!   while someone annotates the Lease every second.
//!
//! "Not deposed" is read from the replica's own log: one term started ("leading: starting
//! the controller"), no "lost leadership", no "lost the lease" (which precedes the fence
//! and the restart of every informer). Before the fix, each of the first two stepped the
//! leader down at the first failed renewal (fence, new term), and in the third the dead
//! holder kept the Lease for as long as the annotations went on.
//!
//! Faults reach the replica through a small HTTP proxy on loopback in front of the API
//! server ([`FaultProxy`]): it forwards every request with the replica's own ServiceAccount
//! token and injects faults only into requests on the replica's Lease. Each test leads its
//! own Lease (a Role below lets the ServiceAccount use these names), so they share the
//! plane.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderName, StatusCode, header};
use integration_tests::harness::ControlPlane;
use integration_tests::harness::controlplane::{OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT};
use integration_tests::operator_process::{OperatorOptions, OperatorProcess};

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(120);
/// The replica's lease duration (the default; `run` has no flag for it).
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How long the Lease requests fail: shorter than the renew deadline (10 s after the last
/// good renewal began; the renewal is due after 5 s, so 5 s of retries).
const FAULT_WINDOW: Duration = Duration::from_secs(3);
/// The Lease names the tests lead (one each), granted by [`TEST_ROLE`].
const LEASES: [&str; 3] = ["renewal-touch", "renewal-faults", "renewal-takeover"];

/// Lets the operator's ServiceAccount get and update the tests' Leases, as
/// `config/rbac/leader_election_role.yaml` does for `egress-operator`.
const TEST_ROLE: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: leader-renewal-tests, namespace: egress-system}
rules:
  - apiGroups: ["coordination.k8s.io"]
    resources: ["leases"]
    resourceNames: ["renewal-touch", "renewal-faults", "renewal-takeover"]
    verbs: ["get", "update"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: leader-renewal-tests, namespace: egress-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: leader-renewal-tests}
subjects:
  - {kind: ServiceAccount, name: egress-operator, namespace: egress-system}
"#;

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < GUARD,
            "{what}: not within {GUARD:?} (hang guard)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// The shared plane with the CRDs, `config/rbac` and [`TEST_ROLE`] applied, once per
/// binary.
fn plane() -> &'static ControlPlane {
    static READY: OnceLock<()> = OnceLock::new();
    let plane = ControlPlane::shared().unwrap_or_else(|e| panic!("{e:#}"));
    READY.get_or_init(|| {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(plane.install_crds()).unwrap();
        plane.install_rbac().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let role = dir.path().join("role.yaml");
        std::fs::write(&role, TEST_ROLE).unwrap();
        plane
            .kubectl_run(&["apply", "-f", &role.to_string_lossy()])
            .unwrap();
    });
    plane
}

/// A valid providers config whose one host is a closed loopback port: the replica elects,
/// reconciles no Proxy, and the health monitor reports the host unreachable.
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
        r#"clusterId: leader-renewal
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

/// One replica leading `lease`, acting through `kubeconfig`.
fn replica(dir: &Path, kubeconfig: &Path, identity: &str, lease: &str) -> OperatorProcess {
    let config = write_config(dir);
    let mut options = OperatorOptions::new(
        &binary(),
        &config,
        kubeconfig,
        identity,
        OPERATOR_NAMESPACE,
        dir,
    );
    options.extra_args = vec!["--lease-name".into(), lease.into()];
    OperatorProcess::start(&options).unwrap()
}

fn leading(op: &OperatorProcess) -> bool {
    matches!(op.http_get("/readyz"), Some((200, body)) if body.contains("leading"))
}

fn lease_field(plane: &ControlPlane, lease: &str, path: &str) -> String {
    plane
        .kubectl_run(&[
            "get",
            "lease",
            lease,
            "-n",
            OPERATOR_NAMESPACE,
            "-o",
            &format!("jsonpath={{{path}}}"),
        ])
        .unwrap_or_default()
}

/// Waits until the holder has renewed `lease` `count` more times (its `renewTime` moved).
fn wait_renewals(plane: &ControlPlane, lease: &str, count: usize) {
    let mut last = lease_field(plane, lease, ".spec.renewTime");
    let mut seen = 0;
    wait_for("renewals of the lease", || {
        let now = lease_field(plane, lease, ".spec.renewTime");
        if now != last {
            seen += 1;
            last = now;
        }
        seen >= count
    });
}

/// The replica led one term from start to now: never stepped down, never fenced, never
/// restarted its informers.
fn assert_one_unbroken_term(op: &OperatorProcess) {
    assert!(
        leading(op),
        "the replica no longer leads; it logged:\n{}",
        op.log()
    );
    let log = op.log();
    let terms = log.matches("leading: starting the controller").count();
    assert_eq!(terms, 1, "terms started (one expected); it logged:\n{log}");
    for sign in ["lost leadership", "lost the lease", "lost the leader lease"] {
        assert!(
            !log.contains(sign),
            "the replica stepped down ({sign:?}); it logged:\n{log}"
        );
    }
}

// ---- The fault-injecting proxy -----------------------------------------------------------

/// Faults the proxy injects into requests on the Lease.
#[derive(Debug, Default)]
struct Faults {
    /// Before each of this many next updates (PUT) of the Lease, the admin annotates it
    /// (`kubectl annotate`), so the update carries a stale resourceVersion.
    touches_left: usize,
    touched: usize,
    /// Armed: every request on the Lease fails for this long from the first one that does.
    fail_for: Option<Duration>,
    fail_until: Option<Instant>,
    /// The faults injected, in order (`500`, `drop`, `429`, `503`).
    failed: Vec<&'static str>,
}

/// How the proxy fails one request, in turn.
const FAULT_CYCLE: [&str; 4] = ["500", "drop", "429", "503"];

/// An HTTP proxy on loopback in front of the API server. The replica talks plain HTTP to
/// it; it forwards each request with a client acting as the operator's ServiceAccount
/// (its token, the plane's CA) and streams the answer back (watches included).
struct FaultProxy {
    addr: SocketAddr,
    faults: Arc<Mutex<Faults>>,
    _rt: tokio::runtime::Runtime,
}

struct ProxyState {
    upstream: kube::Client,
    lease_path: String,
    lease: String,
    faults: Arc<Mutex<Faults>>,
    plane: &'static ControlPlane,
}

/// Headers that belong to one connection, or that the upstream client sets itself.
static NOT_FORWARDED: [HeaderName; 8] = [
    header::CONNECTION,
    header::HOST,
    header::AUTHORIZATION,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

impl FaultProxy {
    fn start(plane: &'static ControlPlane, lease: &str) -> FaultProxy {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let faults = Arc::new(Mutex::new(Faults::default()));
        let addr = rt.block_on(async {
            let kubeconfig = plane.operator_kubeconfig().unwrap();
            let config = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
            let mut config = kube::Config::from_custom_kubeconfig(
                config,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .unwrap();
            // The replica's own client retries what it retries; the proxy adds nothing.
            config.default_retry = false;
            let state = Arc::new(ProxyState {
                upstream: kube::Client::try_from(config).unwrap(),
                lease_path: format!(
                    "/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/{lease}"
                ),
                lease: lease.to_string(),
                faults: faults.clone(),
                plane,
            });
            let app = axum::Router::new().fallback(forward).with_state(state);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await });
            addr
        });
        FaultProxy {
            addr,
            faults,
            _rt: rt,
        }
    }

    /// A kubeconfig that reaches the API server through the proxy (no credentials: the
    /// proxy adds the ServiceAccount's).
    fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let config = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "proxy", "cluster": {"server": format!("http://{}", self.addr)}}],
            "users": [{"name": OPERATOR_SERVICE_ACCOUNT, "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": OPERATOR_SERVICE_ACCOUNT, "namespace": OPERATOR_NAMESPACE}}],
            "current-context": "proxy",
        });
        let path = dir.join("kubeconfig-via-proxy.json");
        std::fs::write(&path, config.to_string()).unwrap();
        path
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.faults.lock().unwrap()
    }
}

impl ProxyState {
    /// The fault for this request on the Lease, if one is due.
    fn fault(&self) -> Option<&'static str> {
        let mut faults = self.faults.lock().unwrap();
        let now = Instant::now();
        if let Some(window) = faults.fail_for.take() {
            faults.fail_until = Some(now + window);
        }
        if faults.fail_until.is_some_and(|until| now < until) {
            let fault = FAULT_CYCLE[faults.failed.len() % FAULT_CYCLE.len()];
            faults.failed.push(fault);
            return Some(fault);
        }
        None
    }

    fn take_touch(&self) -> Option<usize> {
        let mut faults = self.faults.lock().unwrap();
        if faults.touches_left == 0 {
            return None;
        }
        faults.touches_left -= 1;
        faults.touched += 1;
        Some(faults.touched)
    }

    /// `kubectl annotate` of the Lease, as its admin.
    async fn annotate(&self, n: usize) {
        let plane = self.plane;
        let lease = self.lease.clone();
        tokio::task::spawn_blocking(move || {
            plane
                .kubectl_run(&[
                    "annotate",
                    "lease",
                    &lease,
                    "-n",
                    OPERATOR_NAMESPACE,
                    "--overwrite",
                    &format!("egress-operator.dev/touched-by-test={n}"),
                ])
                .unwrap();
        })
        .await
        .unwrap();
    }
}

fn failure(code: StatusCode) -> Response {
    let status = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": "injected by the test's proxy",
        "reason": "InternalError",
        "code": code.as_u16(),
    });
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        status.to_string(),
    )
        .into_response()
}

/// Headers sent, then the body fails: hyper aborts the connection mid-answer, as a peer
/// that goes away (a GOAWAY, a reset) would.
fn dropped() -> Response {
    let broken = futures_util::stream::once(async {
        Err::<axum::body::Bytes, std::io::Error>(std::io::Error::other("injected drop"))
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(broken),
    )
        .into_response()
}

async fn forward(State(state): State<Arc<ProxyState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    if parts.uri.path() == state.lease_path {
        match state.fault() {
            Some("500") => return failure(StatusCode::INTERNAL_SERVER_ERROR),
            Some("429") => return failure(StatusCode::TOO_MANY_REQUESTS),
            Some("503") => return failure(StatusCode::SERVICE_UNAVAILABLE),
            Some(_) => return dropped(),
            None => {}
        }
        if parts.method == http::Method::PUT
            && let Some(n) = state.take_touch()
        {
            state.annotate(n).await;
        }
    }
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let mut upstream = http::Request::builder().method(parts.method).uri(path);
    for (name, value) in &parts.headers {
        if !NOT_FORWARDED.contains(name) {
            upstream = upstream.header(name, value);
        }
    }
    let upstream = match upstream.body(kube::client::Body::from(bytes.to_vec())) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    match state.upstream.send(upstream).await {
        Ok(answer) => {
            let (mut parts, body) = answer.into_parts();
            for name in &NOT_FORWARDED {
                parts.headers.remove(name);
            }
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}

// ---- The tests -----------------------------------------------------------------------------

/// `kubectl annotate` of the Lease lands between the leader's read and its update, three
/// times in a row (the proxy annotates before forwarding each update): each update is
/// refused with a 409. The leader re-reads, finds itself still the holder, and renews;
/// it leads on, one term, nothing fenced or restarted.
#[test]
fn an_annotation_racing_the_renewal_does_not_depose_the_leader() {
    let plane = plane();
    let lease = LEASES[0];
    let proxy = FaultProxy::start(plane, lease);
    let dir = tempfile::tempdir().unwrap();
    let op = replica(
        dir.path(),
        &proxy.kubeconfig(dir.path()),
        "renewal-touch-0",
        lease,
    );
    wait_for("the replica to lead", || leading(&op));
    assert_one_unbroken_term(&op);

    proxy.faults().touches_left = 3;
    wait_for("three annotations racing renewals", || {
        proxy.faults().touched == 3
    });
    // Renewals after the raced one: the leader carried on.
    wait_renewals(plane, lease, 2);
    assert_eq!(
        lease_field(
            plane,
            lease,
            ".metadata.annotations.egress-operator\\.dev/touched-by-test"
        ),
        "3"
    );
    assert_eq!(
        lease_field(plane, lease, ".spec.holderIdentity"),
        "renewal-touch-0"
    );
    assert_one_unbroken_term(&op);
}

/// Every request on the Lease fails for 3 s (500, a dropped connection, 429, 503 in turn;
/// the replica's client retries 429 and 503 itself), starting at a renewal. The leader
/// retries within its renew deadline and leads on, one term, nothing fenced or restarted.
#[test]
fn transient_failures_shorter_than_the_renew_deadline_do_not_depose_the_leader() {
    let plane = plane();
    let lease = LEASES[1];
    let proxy = FaultProxy::start(plane, lease);
    let dir = tempfile::tempdir().unwrap();
    let op = replica(
        dir.path(),
        &proxy.kubeconfig(dir.path()),
        "renewal-faults-0",
        lease,
    );
    wait_for("the replica to lead", || leading(&op));
    assert_one_unbroken_term(&op);

    proxy.faults().fail_for = Some(FAULT_WINDOW);
    wait_for("the fault window to pass", || {
        let faults = proxy.faults();
        faults
            .fail_until
            .is_some_and(|until| Instant::now() > until)
    });
    let failed = proxy.faults().failed.clone();
    assert!(
        failed.contains(&"500") && failed.contains(&"drop"),
        "faults injected: {failed:?}"
    );
    wait_renewals(plane, lease, 2);
    assert_one_unbroken_term(&op);
    let metrics = op.http_get("/metrics").map(|(_, b)| b).unwrap_or_default();
    let retries: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("egress_leader_renewal_retries_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no renewal retries exported:\n{metrics}"));
    assert!(retries >= 2, "{retries} renewal retries for {failed:?}");
    println!("faults injected: {failed:?}; renewals retried: {retries}");
}

/// A holder that stopped renewing (never started here: its record is written by hand)
/// while the admin annotates the Lease every second: the replica takes the Lease over
/// once it has seen the same holder record for the lease duration, not before, although
/// the Lease's resourceVersion never stays the same for more than a second.
#[test]
fn a_dead_holder_is_taken_over_while_someone_touches_the_lease() {
    let plane = plane();
    let lease = LEASES[2];
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.000000Z")
        .to_string();
    let dead = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": lease, "namespace": OPERATOR_NAMESPACE},
        "spec": {
            "holderIdentity": "dead-replica",
            "leaseDurationSeconds": LEASE_DURATION.as_secs(),
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": 0,
        },
    });
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("lease.json");
    std::fs::write(&manifest, dead.to_string()).unwrap();
    plane
        .kubectl_run(&["apply", "-f", &manifest.to_string_lossy()])
        .unwrap();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let toucher = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let mut touches = 0usize;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                touches += 1;
                plane
                    .kubectl_run(&[
                        "annotate",
                        "lease",
                        lease,
                        "-n",
                        OPERATOR_NAMESPACE,
                        "--overwrite",
                        &format!("egress-operator.dev/touched-by-test={touches}"),
                    ])
                    .unwrap();
                std::thread::sleep(Duration::from_secs(1));
            }
            touches
        }
    });
    let kubeconfig = plane.operator_kubeconfig().unwrap();
    let started = Instant::now();
    let op = replica(dir.path(), &kubeconfig, "renewal-takeover-0", lease);
    wait_for("the replica to take the dead holder's lease over", || {
        leading(&op)
    });
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let touches = toucher.join().unwrap();
    assert_eq!(
        lease_field(plane, lease, ".spec.holderIdentity"),
        "renewal-takeover-0"
    );
    // The replica cannot have seen the record before it started: a takeover sooner than
    // the lease duration would be one the protocol forbids.
    assert!(
        took >= LEASE_DURATION,
        "taken over {took:?} after the replica started, before the lease duration"
    );
    assert!(
        touches as u64 >= LEASE_DURATION.as_secs() / 2,
        "the Lease was annotated only {touches} times"
    );
    println!(
        "taken over {:.1} s after the replica started; the Lease was annotated {touches} times",
        took.as_secs_f64()
    );
}
