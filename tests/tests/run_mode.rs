#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `egress-operator run` as a process: it refuses a bad config at start, serves its probes
//! and metrics, talks to the Kubernetes API (a small fake API server on loopback that
//! answers what the controller, GC and health monitor ask), logs JSON lines, and on
//! SIGTERM stops cleanly with exit code 0. A plugin URL that does not answer leaves it
//! running and ready but degraded, and the plugin loads once the URL answers; a plugin
//! cache directory others may write is refused at start.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::IntoResponse;

/// Hang guard for waits below: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(90);

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, String, String)>>>);

impl Seen {
    fn any(&self, f: impl Fn(&str, &str, &str) -> bool) -> bool {
        self.0.lock().unwrap().iter().any(|(m, u, b)| f(m, u, b))
    }
}

/// Answers the requests the operator makes; a watch is held open (no events).
async fn fake_api(
    State(seen): State<Seen>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> impl IntoResponse {
    let path = uri.path().to_string();
    let query = uri.query().unwrap_or_default().to_string();
    let body_text = String::from_utf8_lossy(&body).to_string();
    seen.0
        .lock()
        .unwrap()
        .push((method.to_string(), uri.to_string(), body_text.clone()));
    let json = |v: serde_json::Value| (StatusCode::OK, v.to_string());
    if path == "/version" {
        return json(serde_json::json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0", "gitCommit": "", "gitTreeState": "",
            "buildDate": "", "goVersion": "", "compiler": "", "platform": "linux/amd64"
        }));
    }
    if path == "/api/v1/namespaces/kube-system" && method == Method::GET {
        return json(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "kube-system", "uid": "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887"}
        }));
    }
    // Every collection the operator watches is served empty: a 404 on any of them turns
    // `/readyz` to "watch: degraded" now and then, and the checks below read it.
    let watched = [
        ("/proxies", "egress-operator.dev/v1alpha1", "ProxyList"),
        (
            "/proxypools",
            "egress-operator.dev/v1alpha1",
            "ProxyPoolList",
        ),
        (
            "/proxyleases",
            "egress-operator.dev/v1alpha1",
            "ProxyLeaseList",
        ),
    ];
    if let Some((_, api_version, kind)) = watched
        .iter()
        .find(|(suffix, _, _)| path.ends_with(suffix) && method == Method::GET)
    {
        if query.contains("watch=true") {
            tokio::time::sleep(Duration::from_secs(600)).await;
            return (StatusCode::OK, String::new());
        }
        return json(serde_json::json!({
            "apiVersion": api_version, "kind": kind,
            "metadata": {"resourceVersion": "1"}, "items": []
        }));
    }
    if path.contains("/providerhealths/") && method == Method::PATCH {
        let mut v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        v["metadata"]["name"] = serde_json::json!("kvm2");
        v["metadata"]["resourceVersion"] = serde_json::json!("2");
        return json(v);
    }
    (
        StatusCode::NOT_FOUND,
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "not in the fake"})
        .to_string(),
    )
}

/// The `kvm2.templates.domain` entry of the default plugin, by local path.
fn domain_by_path() -> String {
    let domain = integration_tests::plugin_path("domain-default").unwrap();
    format!("{{path: {}}}", domain.display())
}

fn write_config(dir: &Path, domain: &str) -> PathBuf {
    let key = dir.join("id_ed25519");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(st.success());
    let known = dir.join("known_hosts");
    std::fs::write(&known, "").unwrap();
    // A host on a closed loopback port: the health monitor reports it unreachable.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap();
    drop(closed);
    let vendor = integration_tests::plugin_path("vendor-data-default").unwrap();
    let yaml = format!(
        r#"clusterId: run-test
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
    domain: {domain}
    vendorData: {{path: {vendor}}}
healthCheck: {{periodSeconds: 5, timeoutSeconds: 2}}
gc: {{periodSeconds: 10, gracePeriodSeconds: 600}}
"#,
        key = key.display(),
        known = known.display(),
        sha = "ab".repeat(32),
        vendor = vendor.display(),
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.get(9..12)?.parse().ok()?;
    Some((
        code,
        out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string(),
    ))
}

/// Waits for `f`; on time-out stops the operator and fails with what it logged.
fn wait_for(
    what: &str,
    child: &mut std::process::Child,
    log: &mut Option<std::thread::JoinHandle<String>>,
    mut f: impl FnMut() -> bool,
) {
    let started = Instant::now();
    while !f() {
        if started.elapsed() > GUARD {
            let _ = child.kill();
            let _ = child.wait();
            let text = log.take().map(|h| h.join().unwrap()).unwrap_or_default();
            panic!("timed out waiting for {what}; the operator logged:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_bad_config_is_refused_at_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, "clusterId: prod\nkvm2: {}\n").unwrap();
    let out = Command::new(binary())
        .args(["run", "--config"])
        .arg(&cfg)
        .args(["--http-addr", "127.0.0.1:0", "--no-leader-election"])
        .env("KUBECONFIG", dir.path().join("none"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config.yaml"), "{err}");
    assert!(err.contains("kvm2") && err.contains("ssh"), "{err}");
}

/// Serves [`fake_api`] on loopback in `runtime`; returns what it saw and its address.
fn start_fake_api(runtime: &tokio::runtime::Runtime) -> (Seen, std::net::SocketAddr) {
    let seen = Seen::default();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let api_addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .fallback(fake_api)
        .with_state(seen.clone());
    runtime.spawn(async move { axum::serve(listener, app).await });
    (seen, api_addr)
}

fn write_kubeconfig(dir: &Path, api_addr: std::net::SocketAddr) -> PathBuf {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{api_addr}\"}}\n\
             users:\n- name: u\n  user: {{token: not-a-secret}}\ncontexts:\n- name: c\n  context: {{cluster: fake, user: u, namespace: default}}\n\
             current-context: c\n"
        ),
    )
    .unwrap();
    kubeconfig
}

/// A loopback address nothing listens on (for the operator's HTTP endpoints).
fn free_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().to_string()
}

/// The operator as a process, with its stderr drained all along (a full pipe can never
/// block it).
struct Operator {
    child: std::process::Child,
    log: Option<std::thread::JoinHandle<String>>,
    http_addr: String,
}

impl Operator {
    /// `run --no-leader-election --log-format json` with `cfg`, the plugin cache in
    /// `dir/cache`, and `extra` arguments.
    fn start(cfg: &Path, dir: &Path, kubeconfig: &Path, extra: &[&std::ffi::OsStr]) -> Self {
        let http_addr = free_addr();
        let mut child = Command::new(binary())
            .args(["run", "--config"])
            .arg(cfg)
            .args([
                "--http-addr",
                &http_addr,
                "--no-leader-election",
                "--log-format",
                "json",
            ])
            .arg("--plugin-cache-dir")
            .arg(dir.join("cache"))
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", "egress-operator-test-0")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = child.stderr.take().unwrap();
        let log = Some(std::thread::spawn(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut pipe, &mut text).unwrap();
            text
        }));
        Self {
            child,
            log,
            http_addr,
        }
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(&self.http_addr, path)
    }

    fn wait_for(&mut self, what: &str, f: impl FnMut() -> bool) {
        wait_for(what, &mut self.child, &mut self.log, f);
    }

    /// Waits until `path` answers and `f` accepts the answer.
    fn wait_for_answer(&mut self, what: &str, path: &str, mut f: impl FnMut(u16, &str) -> bool) {
        let addr = self.http_addr.clone();
        self.wait_for(what, || {
            http_get(&addr, path).is_some_and(|(code, body)| f(code, &body))
        });
    }

    /// SIGTERM, then the exit status and everything it logged.
    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let started = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if started.elapsed() > GUARD {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let log = self.log.take().unwrap().join().unwrap();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "the operator did not stop within {GUARD:?} of SIGTERM (hang guard); the end of its log:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let stderr = self.log.take().unwrap().join().unwrap();
        (status, stderr)
    }
}

#[test]
fn runs_serves_probes_and_stops_cleanly_on_sigterm() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (seen, api_addr) = start_fake_api(&runtime);
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &domain_by_path());
    let kubeconfig = write_kubeconfig(dir.path(), api_addr);
    let mut op = Operator::start(&cfg, dir.path(), &kubeconfig, &[]);

    op.wait_for_answer("/readyz", "/readyz", |code, _| code == 200);
    assert_eq!(op.get("/healthz").unwrap().0, 200);
    // Both plugins load from their paths.
    op.wait_for_answer("plugins loaded", "/readyz", |code, body| {
        code == 200 && body.contains("plugins: ok\n")
    });
    // The controller and the GC list Proxies; the health monitor reports the dead host.
    op.wait_for("a Proxy list and watch", || {
        seen.any(|m, u, _| m == "GET" && u.contains("/proxies") && u.contains("watch=true"))
    });
    op.wait_for("a ProviderHealth status write", || {
        seen.any(|m, u, b| {
            m == "PATCH"
                && u.contains("/providerhealths/kvm2/status")
                && b.contains("\"reachable\":false")
        })
    });
    // Families without samples are not printed; these get some once the GC has swept
    // (the dead host is skipped) and the health monitor has checked.
    let wanted = [
        "egress_provider_target_up{provider=\"kvm2\",target=\"h1\"} 0",
        "egress_gc_sweeps_total{result=\"partial\"}",
        "egress_gc_targets_skipped_total",
        "egress_libvirt_calls",
        "egress_template_plugin_up{kind=\"vendor-data\",plugin=\"vendor-data:",
    ];
    op.wait_for_answer("metrics of every component", "/metrics", |code, text| {
        code == 200 && wanted.iter().all(|w| text.contains(w))
    });
    let (status, stderr) = op.terminate();
    assert_eq!(status.code(), Some(0), "stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        assert!(v.get("level").is_some(), "{line}");
    }
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    assert!(
        stderr.lines().any(|l| l.contains("cluster identity")
            && l.contains("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887")),
        "the cluster identity read from kube-system: {stderr}"
    );
    assert!(stderr.contains("\"stopped\""), "{stderr}");
    assert!(
        !stderr.contains("not-a-secret"),
        "the API token leaked into the logs"
    );
}

/// The state of the domain plugin in the `ProviderHealth` status writes seen so far, the
/// latest first.
fn domain_plugin_states(seen: &Seen) -> Vec<String> {
    let writes = seen.0.lock().unwrap().clone();
    writes
        .iter()
        .rev()
        .filter(|(m, u, _)| m == "PATCH" && u.contains("/providerhealths/kvm2/status"))
        .filter_map(|(_, _, b)| {
            let v: serde_json::Value = serde_json::from_str(b).ok()?;
            let plugins = v["status"]["plugins"].as_array()?.clone();
            plugins
                .iter()
                .find(|p| p["kind"] == "domain")
                .map(|p| format!("{} {}", p["state"], p["message"]))
        })
        .collect()
}

/// The domain plugin comes by `url` + `sha256` from a loopback HTTPS server behind a
/// port that first refuses connections: the operator serves its probes all along, is
/// ready but degraded with the plugin's reason (`/readyz`, metrics, `ProviderHealth`),
/// and once the port answers the plugin loads, without a restart.
#[test]
fn a_plugin_url_that_does_not_answer_leaves_it_ready_but_degraded_until_it_answers() {
    use integration_tests::https::{HttpsServer, Reply};

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (seen, api_addr) = start_fake_api(&runtime);
    let dir = tempfile::tempdir().unwrap();

    let bytes = std::fs::read(integration_tests::plugin_path("domain-default").unwrap()).unwrap();
    let sha = integration_tests::sha256_hex(&bytes);
    let server = HttpsServer::start(vec![("/domain.wasm".into(), Reply::Body(bytes))]).unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, server.ca_pem()).unwrap();
    // The URL's port is bound but not listening, so connections to it are refused until
    // the test listens on it (no other process can take the port meanwhile).
    let gate = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        socket
    });
    let gate_addr = gate.local_addr().unwrap();
    let url = format!("https://{gate_addr}/domain.wasm");
    let plugin = format!("domain:{url}");

    let cfg = write_config(
        dir.path(),
        &format!("{{url: \"{url}\", sha256: \"{sha}\"}}"),
    );
    let kubeconfig = write_kubeconfig(dir.path(), api_addr);
    let mut op = Operator::start(
        &cfg,
        dir.path(),
        &kubeconfig,
        &["--plugin-ca-file".as_ref(), ca.as_os_str()],
    );

    // Degraded: ready (leading), with the download's failure as the plugin's reason.
    let degraded = format!(
        "plugin domain \"{plugin}\": loading (retried in the background): cannot download {url}"
    );
    op.wait_for_answer("ready but degraded", "/readyz", |code, body| {
        code == 200
            && body.starts_with("ready: leading\nwatch: ok\nplugins: degraded\n")
            && body.contains(&degraded)
            && body.contains("plugin vendor-data \"vendor-data:")
    });
    assert_eq!(op.get("/healthz").unwrap().0, 200);
    assert_eq!(server.requests(), 0, "nothing reached the server yet");
    let up = format!("egress_template_plugin_up{{kind=\"domain\",plugin=\"{plugin}\"}}");
    op.wait_for_answer("degraded metrics", "/metrics", |_, text| {
        text.contains(&format!("{up} 0"))
            && text.contains(
                "egress_template_plugin_load_attempts_total{kind=\"domain\",outcome=\"transient\"}",
            )
    });
    op.wait_for("ProviderHealth reporting the plugin loading", || {
        domain_plugin_states(&seen)
            .first()
            .is_some_and(|s| s.starts_with("\"Loading\" \"cannot download"))
    });

    // The URL answers: the plugin loads in the same process.
    // Listening registers with the runtime's reactor, so it happens inside it.
    let listener = runtime.block_on(async { gate.listen(16) }).unwrap();
    let upstream = format!("127.0.0.1:{}", server.url("").rsplit(':').next().unwrap());
    runtime.spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    });
    op.wait_for_answer("the plugin loaded", "/readyz", |code, body| {
        code == 200
            && body.starts_with("ready: leading\nwatch: ok\nplugins: ok\n")
            && body.contains(&format!("plugin domain \"{plugin}\": loaded\n"))
    });
    assert!(server.requests() >= 1);
    op.wait_for_answer("healthy metrics", "/metrics", |_, text| {
        text.contains(&format!("{up} 1"))
            && text.contains(
                "egress_template_plugin_load_attempts_total{kind=\"domain\",outcome=\"ok\"} 1",
            )
    });
    op.wait_for("ProviderHealth reporting the plugin loaded", || {
        domain_plugin_states(&seen)
            .first()
            .is_some_and(|s| s == "\"Loaded\" \"\"")
    });
    assert!(op.child.try_wait().unwrap().is_none(), "never restarted");
    let (status, stderr) = op.terminate();
    assert_eq!(status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stderr.contains("template plugin loaded after retries"),
        "{stderr}"
    );
}

/// The domain plugin comes from a registry by `oci://` digest, with credentials from a
/// file that is not there at start (a Secret created after the pod): the plugin is
/// *loading* with that reason, and loads without a restart once the file appears.
#[test]
fn an_oci_plugin_loads_once_its_registry_credentials_appear() {
    use integration_tests::harness::{self, Need, Registry};

    if harness::skip(&[Need::Registry]) {
        return;
    }
    let registry = Registry::start("operator", "run-pw").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("registry/.dockerconfigjson");
    std::fs::create_dir(dir.path().join("registry")).unwrap();
    let staged = dir.path().join("staged.json");
    registry.write_docker_config(&staged).unwrap();
    let pushed = egress_operator::authoring::push::push(
        &integration_tests::plugin_path("domain-default").unwrap(),
        &registry.reference("plugins/domain:run"),
        Some(&staged),
        Some(&registry.ca_file()),
    )
    .unwrap();
    let url = pushed.reference.to_string();
    let plugin = format!("domain:{url}");

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (_seen, api_addr) = start_fake_api(&runtime);
    let cfg = write_config(
        dir.path(),
        &format!(
            "{{url: \"{url}\", credentialsFile: \"{}\"}}",
            auth.display()
        ),
    );
    let kubeconfig = write_kubeconfig(dir.path(), api_addr);
    let ca = registry.ca_file();
    let mut op = Operator::start(
        &cfg,
        dir.path(),
        &kubeconfig,
        &["--plugin-ca-file".as_ref(), ca.as_os_str()],
    );
    let waiting = format!(
        "plugin domain \"{plugin}\": loading (retried in the background): cannot pull {url}: \
         credentials file {}: cannot read it",
        auth.display()
    );
    op.wait_for_answer("loading without credentials", "/readyz", |code, body| {
        code == 200 && body.contains(&waiting)
    });
    std::fs::rename(&staged, &auth).unwrap();
    op.wait_for_answer("the plugin loaded", "/readyz", |code, body| {
        code == 200
            && body.contains("plugins: ok\n")
            && body.contains(&format!("plugin domain \"{plugin}\": loaded\n"))
    });
    assert!(op.child.try_wait().unwrap().is_none(), "never restarted");
    let (status, stderr) = op.terminate();
    assert_eq!(status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        !stderr.contains("run-pw"),
        "the registry password leaked into the logs"
    );
}

/// A plugin cache directory that others may write holds code anyone could have put
/// there: start-up refuses it, naming the directory and why, before serving anything.
#[test]
fn a_world_writable_plugin_cache_is_refused_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &domain_by_path());
    let cache = dir.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = Command::new(binary())
        .args(["run", "--config"])
        .arg(&cfg)
        .args(["--http-addr", "127.0.0.1:0", "--no-leader-election"])
        .arg("--plugin-cache-dir")
        .arg(&cache)
        .env("KUBECONFIG", dir.path().join("none"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&cache.display().to_string())
            && err.contains("has mode 0777, writable by group or others"),
        "{err}"
    );
}
