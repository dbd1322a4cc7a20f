#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `egress-operator run` as a process: it refuses a bad config at start, serves its probes
//! and metrics, talks to the Kubernetes API (a small fake API server on loopback that
//! answers what the controller, GC and health monitor ask), logs JSON lines, and on
//! SIGTERM stops cleanly with exit code 0.

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
    if path.ends_with("/proxies") && method == Method::GET {
        if query.contains("watch=true") {
            tokio::time::sleep(Duration::from_secs(600)).await;
            return (StatusCode::OK, String::new());
        }
        return json(serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyList",
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

fn write_config(dir: &Path) -> PathBuf {
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
    let domain = integration_tests::plugin_path("domain-default").unwrap();
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
    domain: {{path: {domain}}}
    vendorData: {{path: {vendor}}}
healthCheck: {{periodSeconds: 5, timeoutSeconds: 2}}
gc: {{periodSeconds: 10, gracePeriodSeconds: 600}}
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

#[test]
fn runs_serves_probes_and_stops_cleanly_on_sigterm() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let seen = Seen::default();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let api_addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .fallback(fake_api)
        .with_state(seen.clone());
    runtime.spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{api_addr}\"}}\n\
             users:\n- name: u\n  user: {{token: not-a-secret}}\ncontexts:\n- name: c\n  context: {{cluster: fake, user: u, namespace: default}}\n\
             current-context: c\n"
        ),
    )
    .unwrap();
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http_addr = probe.local_addr().unwrap().to_string();
    drop(probe);

    let mut child = Command::new(binary())
        .args(["run", "--config"])
        .arg(&cfg)
        .args([
            "--http-addr",
            &http_addr,
            "--no-leader-election",
            "--log-format",
            "json",
        ])
        .arg("--plugin-cache-dir")
        .arg(dir.path().join("cache"))
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", "egress-operator-test-0")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Drain stderr all along, so a full pipe can never block the operator.
    let mut pipe = child.stderr.take().unwrap();
    let mut reader = Some(std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut text).unwrap();
        text
    }));

    wait_for("/readyz", &mut child, &mut reader, || {
        http_get(&http_addr, "/readyz").is_some_and(|(c, _)| c == 200)
    });
    assert_eq!(http_get(&http_addr, "/healthz").unwrap().0, 200);
    // The controller and the GC list Proxies; the health monitor reports the dead host.
    wait_for("a Proxy list and watch", &mut child, &mut reader, || {
        seen.any(|m, u, _| m == "GET" && u.contains("/proxies") && u.contains("watch=true"))
    });
    wait_for(
        "a ProviderHealth status write",
        &mut child,
        &mut reader,
        || {
            seen.any(|m, u, b| {
                m == "PATCH"
                    && u.contains("/providerhealths/kvm2/status")
                    && b.contains("\"reachable\":false")
            })
        },
    );
    // Families without samples are not printed; these get some once the GC has swept
    // (the dead host is skipped) and the health monitor has checked.
    let wanted = [
        "egress_provider_target_up{provider=\"kvm2\",target=\"h1\"} 0",
        "egress_gc_sweeps_total{result=\"partial\"}",
        "egress_gc_targets_skipped_total",
        "egress_libvirt_calls",
    ];
    wait_for(
        "metrics of every component",
        &mut child,
        &mut reader,
        || {
            http_get(&http_addr, "/metrics")
                .is_some_and(|(code, text)| code == 200 && wanted.iter().all(|w| text.contains(w)))
        },
    );
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < GUARD,
            "the operator did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = reader.take().unwrap().join().unwrap();
    assert_eq!(status.code(), Some(0), "stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        assert!(v.get("level").is_some(), "{line}");
    }
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    assert!(stderr.contains("\"stopped\""), "{stderr}");
    assert!(
        !stderr.contains("not-a-secret"),
        "the API token leaked into the logs"
    );
}
