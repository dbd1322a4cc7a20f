//! The operator's HTTP endpoints: `/metrics` (Prometheus text format), `/healthz`
//! (liveness: the process serves and its main loop is not wedged) and `/readyz`
//! (readiness: config loaded, API server reached, and either leading with the components
//! started or standing by). Plain HTTP/1 on one port; no user data passes through here.
//!
//! Template plugins do not gate readiness: a plugin that is still loading (its URL does
//! not answer yet) or failed for good makes the replica *ready but degraded*. `/readyz`
//! keeps its status code, so the pod is neither restarted nor taken out of service for a
//! plugin (Proxies that need it report the reason in their conditions), and its body
//! says so after the role line:
//!
//! ```text
//! ready: leading
//! plugins: degraded
//! plugin domain "domain:https://example.org/d.wasm": loading (retried in the background): cannot download ...
//! plugin vendor-data "vendor-data:/plugins/v.wasm": loaded
//! ```
//!
//! While leading, a `watch:` line follows the role: `watch: ok`, or `watch: degraded` with
//! a line per reason (the Proxy watch fails, or a Proxy cannot be decoded: a CRD newer
//! than the binary), also without changing the status code: the replica keeps
//! reconciling the Proxies it can read.
//!
//! `plugins: ok` when every plugin is loaded; states are `loaded`, `loading` (not loaded
//! yet, retried) and `failed` (permanent until the config is fixed).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;

use crate::templates::TemplateSet;

/// What this replica is doing, for `/readyz` and the `egress_operator_role` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Starting: config loaded, API server not reached yet.
    Starting = 0,
    /// Waiting for the lease.
    Standby = 1,
    /// Holding the lease; controller, GC and health monitor run.
    Leading = 2,
    /// Shutting down.
    Stopping = 3,
}

/// Shared probe state, written by the run loop, read by the endpoints.
#[derive(Debug, Default)]
pub struct Probes {
    role: AtomicU8,
    wedged: AtomicBool,
    watch: std::sync::OnceLock<crate::controller::watch::WatchHealth>,
    /// The config in force (its plugins are reported) and the last reload's refusal.
    live: std::sync::OnceLock<(
        Arc<crate::config::live::Live>,
        Arc<super::reload::ReloadState>,
    )>,
}

impl Probes {
    /// Reports the plugins of the config in force in `live`, and `reload`'s refusals.
    pub fn set_live(
        &self,
        live: Arc<crate::config::live::Live>,
        reload: Arc<super::reload::ReloadState>,
    ) {
        let _ = self.live.set((live, reload));
    }

    /// Records the role.
    pub fn set_role(&self, role: Role) {
        self.role.store(role as u8, Ordering::SeqCst);
    }

    /// The current role.
    pub fn role(&self) -> Role {
        match self.role.load(Ordering::SeqCst) {
            1 => Role::Standby,
            2 => Role::Leading,
            3 => Role::Stopping,
            _ => Role::Starting,
        }
    }

    /// Marks the process as needing a restart (a component ended unexpectedly).
    pub fn set_wedged(&self) {
        self.wedged.store(true, Ordering::SeqCst);
    }

    /// Ready: standing by or leading.
    pub fn is_ready(&self) -> bool {
        matches!(self.role(), Role::Standby | Role::Leading)
    }

    /// Reports the Proxy watch's health in the `/readyz` body while leading.
    pub fn set_watch(&self, health: crate::controller::watch::WatchHealth) {
        let _ = self.watch.set(health);
    }

    /// Live: not wedged.
    pub fn is_live(&self) -> bool {
        !self.wedged.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct AppState {
    probes: Arc<Probes>,
    registry: Arc<Registry>,
    plugins: Option<Arc<TemplateSet>>,
}

/// The router; `registry` must hold every metric before it is shared here. `plugins`, when
/// given, is reported in the `/readyz` body (never in its status code).
pub fn router(
    probes: Arc<Probes>,
    registry: Arc<Registry>,
    plugins: Option<Arc<TemplateSet>>,
) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            probes,
            registry,
            plugins,
        })
}

/// The plugin part of the `/readyz` body (see the module docs).
pub fn plugin_report(set: &TemplateSet) -> String {
    let health = set.health();
    let mut out = String::from(if health.iter().all(|h| h.is_healthy()) {
        "plugins: ok\n"
    } else {
        "plugins: degraded\n"
    });
    for h in &health {
        out.push_str(&format!(
            "plugin {} {:?}: {}",
            h.kind.as_str(),
            h.plugin,
            h.state()
        ));
        if let Some(problem) = &h.problem {
            if h.loading {
                out.push_str(" (retried in the background)");
            }
            // One line per plugin, whatever the reason holds.
            out.push_str(&format!(": {}", problem.replace(['\r', '\n'], " ")));
        }
        out.push('\n');
    }
    out
}

/// The watch part of the `/readyz` body: `watch: ok`, or `watch: degraded` and why, one
/// line each (a failing watch, Proxies that cannot be decoded).
pub fn watch_report(health: &crate::controller::watch::WatchHealth) -> String {
    match health.degraded() {
        None => "watch: ok\n".to_string(),
        Some(lines) => {
            let mut out = String::from("watch: degraded\n");
            for l in lines {
                out.push_str(&l.replace(['\r', '\n'], " "));
                out.push('\n');
            }
            out
        }
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}\n"),
        )
            .into_response(),
    }
}

async fn healthz(State(s): State<AppState>) -> Response {
    if s.probes.is_live() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "a component stopped unexpectedly\n",
        )
            .into_response()
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    let role = s.probes.role();
    let text = match role {
        Role::Starting => "starting: Kubernetes API not reached yet\n",
        Role::Standby => "ready: standing by for the lease\n",
        Role::Leading => "ready: leading\n",
        Role::Stopping => "stopping\n",
    };
    let code = if s.probes.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = text.to_string();
    if role == Role::Leading
        && let Some(health) = s.probes.watch.get()
    {
        body.push_str(&watch_report(health));
    }
    if let Some((live, reload)) = s.probes.live.get() {
        body.push_str(&plugin_report(&live.templates()));
        body.push_str(&reload.report());
    } else if let Some(set) = &s.plugins {
        body.push_str(&plugin_report(set));
    }
    (code, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    async fn get_text(app: Router, path: &str) -> (u16, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        server.abort();
        let code = out[9..12].parse().unwrap();
        let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
        (code, body)
    }

    #[tokio::test]
    async fn probes_follow_the_role_and_metrics_are_served() {
        let mut registry = Registry::default();
        let c = Counter::<u64>::default();
        registry.register("egress_test_things", "things", c.clone());
        c.inc();
        let registry = Arc::new(registry);
        let probes = Arc::new(Probes::default());
        let app = || router(probes.clone(), registry.clone(), None);

        assert_eq!(get_text(app(), "/readyz").await.0, 503);
        assert_eq!(get_text(app(), "/healthz").await.0, 200);
        probes.set_role(Role::Standby);
        assert_eq!(
            get_text(app(), "/readyz").await,
            (200, "ready: standing by for the lease\n".into())
        );
        probes.set_role(Role::Leading);
        assert_eq!(get_text(app(), "/readyz").await.0, 200);
        probes.set_role(Role::Stopping);
        assert_eq!(get_text(app(), "/readyz").await.0, 503);
        probes.set_wedged();
        assert_eq!(get_text(app(), "/healthz").await.0, 503);

        let (code, body) = get_text(app(), "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.contains("egress_test_things_total 1"), "{body}");
        assert_eq!(get_text(app(), "/nothing").await.0, 404);
    }

    #[tokio::test]
    async fn readyz_reports_a_failing_watch_as_degraded_while_leading() {
        let probes = Arc::new(Probes::default());
        let health = crate::controller::watch::WatchHealth::default();
        probes.set_watch(health.clone());
        probes.set_role(Role::Leading);
        let app = || router(probes.clone(), Arc::new(Registry::default()), None);
        assert_eq!(
            get_text(app(), "/readyz").await,
            (200, "ready: leading\nwatch: ok\n".into())
        );
        health.watch_failed(&kube::runtime::watcher::Error::NoResourceVersion);
        let (code, body) = get_text(app(), "/readyz").await;
        assert_eq!(code, 200);
        assert!(
            body.starts_with("ready: leading\nwatch: degraded\nwatch failing: "),
            "{body}"
        );
        health.watch_ok();
        assert_eq!(
            get_text(app(), "/readyz").await.1,
            "ready: leading\nwatch: ok\n"
        );
    }

    #[tokio::test]
    async fn readyz_stays_ready_but_reports_degraded_plugins() {
        use crate::error::{Classified as _, ErrorClass};
        use crate::templates::{TemplateError, TemplateErrorKind, TemplateKind};

        let templates: crate::config::TemplatesConfig = serde_json::from_value(serde_json::json!({
            "domain": { "url": "https://127.0.0.1:1/d.wasm", "sha256": "ab".repeat(32) },
            "vendorData": { "path": "/p/v.wasm" },
        }))
        .unwrap();
        let set = Arc::new(TemplateSet::loading(&templates));
        let probes = Arc::new(Probes::default());
        probes.set_role(Role::Leading);
        let app = || {
            router(
                probes.clone(),
                Arc::new(Registry::default()),
                Some(set.clone()),
            )
        };
        let (code, body) = get_text(app(), "/readyz").await;
        assert_eq!(code, 200, "a plugin never makes the replica unready");
        assert_eq!(
            body,
            "ready: leading\nplugins: degraded\n\
             plugin domain \"domain:https://127.0.0.1:1/d.wasm\": loading (retried in the background): no load attempt has finished yet\n\
             plugin vendor-data \"vendor-data:/p/v.wasm\": loading (retried in the background): no load attempt has finished yet\n"
        );

        set.mark_failed(
            TemplateKind::VendorData,
            &TemplateError {
                plugin: "vendor-data:/p/v.wasm".into(),
                kind: TemplateErrorKind::ForbiddenImport {
                    imports: vec!["wasi:sockets/tcp".into()],
                },
            },
            false,
        );
        assert_eq!(
            set.vendor_data().unwrap_err().class(),
            ErrorClass::Permanent
        );
        let (code, body) = get_text(app(), "/readyz").await;
        assert_eq!(code, 200);
        let line = body.lines().nth(3).unwrap();
        assert!(
            line.starts_with(
                "plugin vendor-data \"vendor-data:/p/v.wasm\": failed: imports wasi:sockets/tcp"
            ),
            "{body}"
        );
        // Not ready for its own reasons: still 503, with the plugins reported.
        probes.set_role(Role::Starting);
        let (code, body) = get_text(app(), "/readyz").await;
        assert_eq!(code, 503);
        assert!(body.contains("plugins: degraded"), "{body}");
    }
}
