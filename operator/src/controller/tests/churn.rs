//! The whole controller loop against a mock API server that behaves like one where it
//! matters here: it lists and watches Proxies, and every status apply or finalizer patch
//! that changes the object bumps its resourceVersion and is sent to the open watches, as
//! the API server does. So the controller sees its own writes come back as triggers, and
//! the test counts provider calls over hours of simulated (paused) time.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::*;

const COLLECTION: &str = "/apis/egress-operator.dev/v1alpha1/proxies";
/// More provider calls than this within the test means the controller loops.
const HOT_LOOP: usize = 500;
const HOUR: Duration = Duration::from_secs(3600);

/// The API server's one Proxy, its resourceVersion, and the open watches.
struct Cluster {
    state: Mutex<ClusterState>,
}

struct ClusterState {
    proxy: Option<Value>,
    rv: u64,
    watches: Vec<mpsc::UnboundedSender<bytes::Bytes>>,
    status_writes: usize,
    events: Vec<Value>,
}

impl Cluster {
    fn new(proxy: &Proxy) -> Arc<Self> {
        let mut value = serde_json::to_value(proxy).unwrap();
        value["metadata"]["resourceVersion"] = json!("100");
        Arc::new(Self {
            state: Mutex::new(ClusterState {
                proxy: Some(value),
                rv: 100,
                watches: Vec::new(),
                status_writes: 0,
                events: Vec::new(),
            }),
        })
    }

    fn proxy(&self) -> Option<Value> {
        self.state.lock().unwrap().proxy.clone()
    }

    fn status_writes(&self) -> usize {
        self.state.lock().unwrap().status_writes
    }

    fn warnings(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap()
            .events
            .iter()
            .filter(|e| e["type"] == "Warning")
            .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Changes the object as a user (or the API server) would, and tells the watches.
    fn edit(&self, f: impl FnOnce(&mut Value)) {
        let mut s = self.state.lock().unwrap();
        let mut p = s.proxy.clone().expect("the Proxy is gone");
        f(&mut p);
        Self::store(&mut s, Some(p), "MODIFIED");
    }

    /// Stores the new object (or its deletion) under a new resourceVersion and sends the
    /// watch event.
    fn store(s: &mut ClusterState, new: Option<Value>, kind: &str) {
        s.rv += 1;
        let rv = s.rv.to_string();
        let object = match new {
            Some(mut p) => {
                p["metadata"]["resourceVersion"] = json!(rv);
                s.proxy = Some(p.clone());
                p
            }
            None => {
                let mut p = s.proxy.take().expect("deleted twice");
                p["metadata"]["resourceVersion"] = json!(rv);
                p
            }
        };
        let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap();
        line.push(b'\n');
        let line = bytes::Bytes::from(line);
        s.watches.retain(|w| w.send(line.clone()).is_ok());
    }

    fn answer(
        &self,
        method: &str,
        path: &str,
        query: &str,
        body: Value,
    ) -> Response<axum::body::Body> {
        let json_reply = |code: u16, v: Value| {
            Response::builder()
                .status(code)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(axum::body::Body::from(serde_json::to_vec(&v).unwrap()))
                .unwrap()
        };
        let mut s = self.state.lock().unwrap();
        if path == COLLECTION && method == "GET" {
            if query.contains("watch=true") {
                let (tx, rx) = mpsc::unbounded_channel();
                s.watches.push(tx);
                let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|line| (Ok::<_, Infallible>(line), rx))
                });
                return Response::builder()
                    .status(200)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(axum::body::Body::from_stream(stream))
                    .unwrap();
            }
            let items: Vec<Value> = s.proxy.iter().cloned().collect();
            return json_reply(
                200,
                json!({"apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyList",
                       "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
            );
        }
        if path == EVENTS_PATH || path.starts_with(&format!("{EVENTS_PATH}/")) {
            s.events.push(body.clone());
            let mut e = body;
            e["metadata"]["resourceVersion"] = json!("1");
            return json_reply(if method == "POST" { 201 } else { 200 }, e);
        }
        let Some(current) = s.proxy.clone() else {
            return json_reply(
                404,
                status_error(404, "NotFound", "proxies \"p\" not found"),
            );
        };
        if method == "PATCH" && path == format!("{PROXY_PATH}/status") {
            s.status_writes += 1;
            let mut p = current.clone();
            p["status"] = body["status"].clone();
            if p != current {
                Self::store(&mut s, Some(p), "MODIFIED");
            }
            return json_reply(200, s.proxy.clone().unwrap());
        }
        if method == "PATCH" && path == PROXY_PATH {
            let mut p = current;
            let mut finalizers: Vec<Value> = p["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for op in body.as_array().into_iter().flatten() {
                let path = op["path"].as_str().unwrap_or_default();
                match (op["op"].as_str(), path) {
                    (Some("add"), "/metadata/finalizers") => {
                        finalizers = op["value"].as_array().cloned().unwrap_or_default()
                    }
                    (Some("add"), "/metadata/finalizers/-") => finalizers.push(op["value"].clone()),
                    (Some("remove"), p) if p.starts_with("/metadata/finalizers/") => {
                        let i: usize = p.rsplit('/').next().unwrap().parse().unwrap();
                        finalizers.remove(i);
                    }
                    _ => {}
                }
            }
            p["metadata"]["finalizers"] = json!(finalizers);
            let gone = finalizers.is_empty() && !p["metadata"]["deletionTimestamp"].is_null();
            if gone {
                s.proxy = Some(p.clone());
                Self::store(&mut s, None, "DELETED");
            } else {
                Self::store(&mut s, Some(p.clone()), "MODIFIED");
            }
            return json_reply(200, p);
        }
        json_reply(
            404,
            status_error(404, "NotFound", &format!("the mock has no {method} {path}")),
        )
    }

    fn client(self: &Arc<Self>) -> Client {
        let (service, mut handle) =
            tower_test::mock::pair::<Request<Body>, Response<axum::body::Body>>();
        let cluster = self.clone();
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                let reply = cluster.answer(
                    parts.method.as_str(),
                    parts.uri.path(),
                    parts.uri.query().unwrap_or_default(),
                    body,
                );
                send.send_response(reply);
            }
        });
        Client::new(service, "default")
    }
}

/// The fake provider, each call stamped with the (paused) time it was made at.
struct Stamped {
    inner: Arc<FakeProvider>,
    at: Mutex<Vec<(Instant, &'static str)>>,
    count: AtomicUsize,
    looping: Notify,
}

impl Stamped {
    fn record(&self, op: &'static str) {
        self.at.lock().unwrap().push((Instant::now(), op));
        if self.count.fetch_add(1, Ordering::Relaxed) + 1 >= HOT_LOOP {
            self.looping.notify_one();
        }
    }

    /// Calls made in `[from, to)` after `t0`.
    fn between(&self, t0: Instant, from: Duration, to: Duration) -> Vec<&'static str> {
        self.at
            .lock()
            .unwrap()
            .iter()
            .filter(|(at, _)| *at >= t0 + from && *at < t0 + to)
            .map(|(_, op)| *op)
            .collect()
    }
}

impl Provider for Stamped {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.record("create");
        self.inner.create(req)
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.record("get");
        self.inner.get(id)
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.record("delete");
        self.inner.delete(id)
    }
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.record("delete");
        self.inner.delete_owned(id, owner)
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        self.record("list");
        self.inner.list()
    }
}

/// Lets simulated time pass while the controller runs; fails if it loops instead (then
/// the paused clock would never move).
async fn let_pass(provider: &Stamped, d: Duration) {
    tokio::select! {
        () = tokio::time::sleep(d) => {}
        () = provider.looping.notified() => panic!(
            "the controller loops: {} provider calls without time passing",
            provider.count.load(Ordering::Relaxed)
        ),
    }
}

/// The "done when": a Proxy whose instance crashed and whose replacement keeps
/// failing (with a different message each time) makes a handful of provider calls an hour
/// once the first minutes are over, although each failure writes a status the watch
/// brings back at once. A spec change and a deletion are still acted on at once.
#[tokio::test(start_paused = true)]
async fn a_replacement_that_keeps_failing_makes_a_handful_of_provider_calls_an_hour() {
    let crashed = instance(id("h2", &our_name()), UID, InstanceState::Crashed, None);
    let p = with_status(proxy(), status_seeing(&crashed));
    let cluster = Cluster::new(&p);
    let fake = Arc::new(FakeProvider::named("kvm2", &["h1", "h2"]));
    fake.insert(crashed);
    fake.fail_always("create", Some(ErrorClass::Transient));
    let provider = Arc::new(Stamped {
        inner: fake.clone(),
        at: Mutex::new(Vec::new()),
        count: AtomicUsize::new(0),
        looping: Notify::new(),
    });
    let mut registry = Registry::new();
    registry.insert(provider.clone());
    let mut ctx = Context::new(
        cluster.client(),
        config(),
        Arc::new(registry),
        ControllerMetrics::default(),
        Some("egress-operator-0".into()),
    );
    // The bottom of the jitter band: the shortest delays, the most calls.
    ctx.jitter = || 0.0;
    Proxies::default().install(&mut ctx);
    let ctx = Arc::new(ctx);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let t0 = Instant::now();
    let runner = tokio::spawn(run(ctx.clone(), 2, async move {
        let _ = stop_rx.await;
    }));

    let_pass(&provider, 3 * HOUR).await;

    let first = provider.between(t0, Duration::ZERO, HOUR);
    let second = provider.between(t0, HOUR, 2 * HOUR);
    let third = provider.between(t0, 2 * HOUR, 3 * HOUR);
    assert_eq!(
        &first[..3],
        &["get", "delete", "create"],
        "the crashed instance is deleted once"
    );
    assert!(first[3..].iter().all(|op| *op == "create"), "{first:?}");
    assert!(first.len() <= 16, "first hour: {first:?}");
    for (hour, calls) in [(2, &second), (3, &third)] {
        assert!(
            !calls.is_empty() && calls.len() <= 5,
            "hour {hour}: {} provider calls: {calls:?}",
            calls.len()
        );
    }
    // Every failure wrote its status, and each write came back as a watch event.
    let creates = first.len() + second.len() + third.len() - 2;
    assert!(
        cluster.status_writes() >= creates,
        "{} writes",
        cluster.status_writes()
    );
    assert!(ctx.metrics.deferred_triggers() >= creates as u64 - 1);
    // One warning per reason for the whole streak.
    assert_eq!(
        cluster.warnings(),
        labels(&["InstanceFailed", "ProviderError"])
    );

    // The spec changes and the provider recovers: reconciled at once, not in 12 minutes.
    fake.fail_always("create", None);
    let edited = Instant::now();
    cluster.edit(|p| {
        p["metadata"]["generation"] = json!(GENERATION + 1);
        p["spec"]["host"] = json!("h1");
    });
    let_pass(&provider, Duration::from_secs(1)).await;
    assert_eq!(
        provider.between(t0, edited - t0, edited - t0 + HOUR),
        vec!["create"]
    );
    let status = cluster.proxy().unwrap()["status"].clone();
    assert_eq!(status["phase"], "Running", "{status:#}");
    assert_eq!(status["observedGeneration"], GENERATION + 1);

    // Deleted: the finalizer's cleanup runs at once and the Proxy goes.
    let deleted = Instant::now();
    cluster.edit(|p| {
        p["metadata"]["generation"] = json!(GENERATION + 2);
        p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    });
    let_pass(&provider, Duration::from_secs(1)).await;
    assert_eq!(
        provider.between(t0, deleted - t0, deleted - t0 + HOUR),
        vec!["delete", "list"]
    );
    assert!(cluster.proxy().is_none(), "the finalizer was not removed");
    assert!(fake.instances().is_empty());

    stop_tx.send(()).unwrap();
    runner.await.unwrap();
}

/// Probing a proxy that keeps serving costs no status write and no event: hours of
/// probes every period leave the object as it was, and the provider is asked only every
/// `ready_refresh`.
#[tokio::test(start_paused = true)]
async fn a_steady_proxy_is_probed_every_period_without_writing_status() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let cluster = Cluster::new(&p);
    let fake = Arc::new(FakeProvider::named("kvm2", &["h1", "h2"]));
    fake.insert(running);
    let provider = Arc::new(Stamped {
        inner: fake.clone(),
        at: Mutex::new(Vec::new()),
        count: AtomicUsize::new(0),
        looping: Notify::new(),
    });
    let mut registry = Registry::new();
    registry.insert(provider.clone());
    let mut ctx = Context::new(
        cluster.client(),
        config(),
        Arc::new(registry),
        ControllerMetrics::default(),
        Some("egress-operator-0".into()),
    );
    ctx.jitter = || 0.0;
    let proxies = Proxies::default();
    proxies.install(&mut ctx);
    let ctx = Arc::new(ctx);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let t0 = Instant::now();
    let runner = tokio::spawn(run(ctx.clone(), 2, async move {
        let _ = stop_rx.await;
    }));

    let_pass(&provider, 3 * HOUR).await;

    let period = u64::from(ctx.config.serving.period_seconds);
    let probes = (3 * HOUR.as_secs() / period) as usize;
    assert!(
        (probes - 2..=probes + 2).contains(&proxies.dials()),
        "{} probes in 3 h at one per {period} s",
        proxies.dials()
    );
    assert_eq!(
        cluster.status_writes(),
        0,
        "a steady proxy's status is left alone"
    );
    assert!(cluster.state.lock().unwrap().events.is_empty());
    let refreshes = (HOUR.as_secs() / ctx.policy.ready_refresh.as_secs()) as usize;
    for hour in 0..3 {
        let calls = provider.between(t0, hour * HOUR, (hour + 1) * HOUR);
        assert!(
            calls.iter().all(|c| *c == "get") && calls.len() <= refreshes + 1,
            "hour {hour}: {calls:?}"
        );
    }

    stop_tx.send(()).unwrap();
    runner.await.unwrap();
}
