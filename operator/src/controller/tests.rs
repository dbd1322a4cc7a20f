//! Controller scenarios against a mock API server (tower-test) and the fake provider.
//!
//! Each scenario builds a Proxy, a [`Context`] whose client talks to an in-process API
//! server (a task answering `tower_test` mock requests), and a [`FakeProvider`] registered
//! as `kvm2`. It then calls [`reconcile`] (and [`error_policy`]) directly and checks the
//! whole conversation: every API request, every event and every provider call lands, in
//! order, in one timeline, so a test states exactly what a reconcile did and in which
//! order (e.g. "the finalizer goes only after the instance is deleted"). Request details
//! (paths, server-side apply parameters, JSON patch bodies, status fields) are checked
//! where they matter.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::client::Body;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use super::*;
use crate::api::proxy::{ProxySpec, SecretKeyRef, UserDataSource};
use crate::provider::fake::FakeProvider;
use crate::provider::{BoxFuture, InstanceState, Provider, TargetListing};
use crate::serving::{Dialer, ProbeStream};

const NS: &str = "ns";
const NAME: &str = "p";
const UID: &str = "5b0c7e4e-0000-4000-8000-00000000a001";
const GENERATION: i64 = 3;
const SECRET_NAME: &str = "proxy-ud";
const SECRET_KEY: &str = "user-data";
/// The user-data: must reach the provider and nothing else.
const USER_DATA: &[u8] = b"#cloud-config\nchpasswd: {list: 'root:hunter2-do-not-leak'}\n";
const LEAK_MARKER: &str = "hunter2-do-not-leak";
const FAKE_ADDRESS: &str = "192.0.2.10";
const PROXY_PATH: &str = "/apis/egress-operator.dev/v1alpha1/namespaces/ns/proxies/p";
const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/ns/events";
const SECRETS_PATH: &str = "/api/v1/namespaces/ns/secrets/";
/// Hang guard: a request the mock never answers fails the test instead of hanging it.
const HANG_GUARD: Duration = Duration::from_secs(30);

/// A small providers config: two hosts, one image, one machine type, defaults for both.
const CONFIG: &str = r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
    - {name: h2, address: "h2.example.org", storagePool: default, bridge: br0}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm}
    vendorData: {path: /p/vendor-data.wasm}
"#;

// ---- The timeline ------------------------------------------------------------------------

/// One API request as the mock server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    query: BTreeMap<String, String>,
    content_type: String,
    /// The body as JSON (`Null` when empty, a string when it was not JSON).
    body: Value,
}

impl Seen {
    fn is_status_apply(&self) -> bool {
        self.method == "PATCH" && self.path == format!("{PROXY_PATH}/status")
    }

    fn is_finalizer_patch(&self) -> bool {
        self.method == "PATCH" && self.path == PROXY_PATH
    }

    fn is_event(&self) -> bool {
        self.path == EVENTS_PATH || self.path.starts_with(&format!("{EVENTS_PATH}/"))
    }

    /// A short name for timelines.
    fn label(&self) -> String {
        if self.is_status_apply() {
            let phase = self.body["status"]["phase"].as_str().unwrap_or("-");
            return format!("status:{phase}");
        }
        if self.is_finalizer_patch() {
            let ops: Vec<&str> = self
                .body
                .as_array()
                .map(|a| a.iter().filter_map(|op| op["op"].as_str()).collect())
                .unwrap_or_default();
            if ops.contains(&"remove") {
                return "finalizer:remove".into();
            }
            if ops.contains(&"add") {
                return "finalizer:add".into();
            }
        }
        if self.method == "GET"
            && let Some(name) = self.path.strip_prefix(SECRETS_PATH)
        {
            return format!("secret:{name}");
        }
        if self.is_event() {
            let type_ = self.body["type"].as_str().unwrap_or("-");
            let reason = self.body["reason"].as_str().unwrap_or("-");
            return format!("event:{type_}:{reason}");
        }
        format!("{} {}", self.method, self.path)
    }
}

#[derive(Debug, Clone)]
enum Step {
    Api(Seen),
    Provider(&'static str),
}

/// Everything that happened, in order.
#[derive(Debug, Clone, Default)]
struct Timeline(Arc<Mutex<Vec<Step>>>);

impl Timeline {
    fn push(&self, step: Step) {
        self.0.lock().unwrap().push(step);
    }

    fn steps(&self) -> Vec<Step> {
        self.0.lock().unwrap().clone()
    }

    /// The timeline as labels: `status:PHASE`, `finalizer:add|remove`, `secret:NAME`,
    /// `event:TYPE:REASON`, `provider:OP`.
    fn labels(&self) -> Vec<String> {
        self.steps()
            .iter()
            .map(|s| match s {
                Step::Api(seen) => seen.label(),
                Step::Provider(op) => format!("provider:{op}"),
            })
            .collect()
    }

    fn requests(&self) -> Vec<Seen> {
        self.steps()
            .into_iter()
            .filter_map(|s| match s {
                Step::Api(seen) => Some(seen),
                Step::Provider(_) => None,
            })
            .collect()
    }

    /// The `status` of every status apply, in order.
    fn statuses(&self) -> Vec<Value> {
        self.requests()
            .into_iter()
            .filter(Seen::is_status_apply)
            .map(|s| s.body["status"].clone())
            .collect()
    }

    fn last_status(&self) -> Value {
        self.statuses().pop().expect("no status was applied")
    }

    /// Every event body, in order.
    fn events(&self) -> Vec<Value> {
        self.requests()
            .into_iter()
            .filter(Seen::is_event)
            .map(|s| s.body)
            .collect()
    }

    /// `(type, reason, note)` of every event, in order.
    fn event_summary(&self) -> Vec<(String, String, String)> {
        self.events()
            .iter()
            .map(|e| {
                (
                    e["type"].as_str().unwrap_or_default().to_string(),
                    e["reason"].as_str().unwrap_or_default().to_string(),
                    e["note"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    }

    fn finalizer_patches(&self) -> Vec<Seen> {
        self.requests()
            .into_iter()
            .filter(Seen::is_finalizer_patch)
            .collect()
    }

    /// Forgets everything so far (between two reconciles of one scenario).
    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

// ---- The mock API server -----------------------------------------------------------------

/// Answers a request instead of the default handler when it returns `Some((code, body))`.
type Override = Box<dyn FnMut(&Seen) -> Option<(u16, Value)> + Send>;

/// A Kubernetes `Status` error body, as the API server sends it.
fn status_error(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// The default answers: the Proxy echoed back with the applied status, Secrets from
/// `secrets` (404 otherwise), events accepted, anything else a 404 (which the timeline
/// shows, so an unexpected request fails the scenario's timeline assertion).
fn default_answer(seen: &Seen, proxy: &Value, secrets: &BTreeMap<String, Value>) -> (u16, Value) {
    if seen.is_status_apply() {
        let mut p = proxy.clone();
        p["status"] = seen.body["status"].clone();
        return (200, p);
    }
    if seen.is_finalizer_patch() {
        return (200, proxy.clone());
    }
    if seen.is_event() {
        let mut e = seen.body.clone();
        e["metadata"]["resourceVersion"] = json!("1");
        return (if seen.method == "POST" { 201 } else { 200 }, e);
    }
    if seen.method == "GET"
        && let Some(name) = seen.path.strip_prefix(SECRETS_PATH)
    {
        return match secrets.get(name) {
            Some(s) => (200, s.clone()),
            None => (
                404,
                status_error(404, "NotFound", &format!("secrets \"{name}\" not found")),
            ),
        };
    }
    (
        404,
        status_error(
            404,
            "NotFound",
            &format!("the mock has no {} {}", seen.method, seen.path),
        ),
    )
}

/// Starts the mock API server for `proxy`; returns a client of it.
fn api_server(
    proxy: &Proxy,
    secrets: &[Secret],
    mut answer: Option<Override>,
    timeline: Timeline,
) -> Client {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let proxy = serde_json::to_value(proxy).unwrap();
    let secrets: BTreeMap<String, Value> = secrets
        .iter()
        .map(|s| {
            (
                s.metadata.name.clone().unwrap(),
                serde_json::to_value(s).unwrap(),
            )
        })
        .collect();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
            };
            let query = parts
                .uri
                .query()
                .unwrap_or_default()
                .split('&')
                .filter(|kv| !kv.is_empty())
                .map(|kv| match kv.split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (kv.to_string(), String::new()),
                })
                .collect();
            let seen = Seen {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
                query,
                content_type: parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string(),
                body,
            };
            timeline.push(Step::Api(seen.clone()));
            let (code, reply) = answer
                .as_mut()
                .and_then(|a| a(&seen))
                .unwrap_or_else(|| default_answer(&seen, &proxy, &secrets));
            let response = Response::builder()
                .status(code)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap();
            send.send_response(response);
        }
    });
    Client::new(service, "default")
}

// ---- The provider, seen through the timeline ---------------------------------------------

/// The fake provider, each call also written to the timeline.
struct Logged {
    inner: Arc<FakeProvider>,
    timeline: Timeline,
}

impl Provider for Logged {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn revision(
        &self,
        spec: &ProxySpec,
        host: Option<&str>,
        user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        self.inner.revision(spec, host, user_data)
    }

    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.timeline.push(Step::Provider("create"));
        self.inner.create(req)
    }

    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.timeline.push(Step::Provider("get"));
        self.inner.get(id)
    }

    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.timeline.push(Step::Provider("delete"));
        self.inner.delete(id)
    }

    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.timeline.push(Step::Provider("delete"));
        self.inner.delete_owned(id, owner)
    }

    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        self.timeline.push(Step::Provider("list"));
        self.inner.list()
    }
}

// ---- The proxies, in memory --------------------------------------------------------------

/// How an in-memory proxy answers the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// `HTTP/1.1 200 Connection established`.
    Serve,
    /// The connection is refused (nothing listens).
    Refuse,
    /// Accepts and never answers (only in tests with paused time: the probe times out).
    Hang,
}

/// The guests' proxies: every probe lands here, in memory, never on a network. Each
/// address answers [`Answer::Serve`] until told otherwise; dials are counted.
#[derive(Debug, Clone, Default)]
struct Proxies(Arc<ProxiesInner>);

#[derive(Debug, Default)]
struct ProxiesInner {
    answers: Mutex<HashMap<IpAddr, Answer>>,
    dials: AtomicUsize,
}

impl Proxies {
    fn set(&self, ip: &str, answer: Answer) {
        self.0
            .answers
            .lock()
            .unwrap()
            .insert(ip.parse().unwrap(), answer);
    }

    fn dials(&self) -> usize {
        self.0.dials.load(Ordering::SeqCst)
    }

    /// Probes go to these proxies from now on (and the clock follows paused time).
    fn install(&self, ctx: &mut Context) {
        ctx.prober = crate::serving::Prober::with_dialer(
            &ctx.config.serving,
            Arc::new(self.clone()),
            ctx.metrics.probes.clone(),
        );
        ctx.clock = paused_clock();
    }
}

impl Dialer for Proxies {
    fn dial(
        &self,
        addr: SocketAddr,
    ) -> crate::serving::BoxFuture<'_, std::io::Result<Box<dyn ProbeStream>>> {
        self.0.dials.fetch_add(1, Ordering::SeqCst);
        let answer = self
            .0
            .answers
            .lock()
            .unwrap()
            .get(&addr.ip())
            .copied()
            .unwrap_or(Answer::Serve);
        Box::pin(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            if answer == Answer::Refuse {
                return Err(std::io::ErrorKind::ConnectionRefused.into());
            }
            let (client, mut proxy) = tokio::io::duplex(4096);
            tokio::spawn(async move {
                let mut head = [0u8; 512];
                let _ = proxy.read(&mut head).await;
                if answer == Answer::Serve {
                    let _ = proxy
                        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                        .await;
                }
                let mut rest = Vec::new();
                let _ = proxy.read_to_end(&mut rest).await;
            });
            Ok(Box::new(client) as Box<dyn ProbeStream>)
        })
    }
}

/// A wall clock that moves with tokio's (paused) time: starts at the real now.
fn paused_clock() -> Clock {
    let base = jiff::Timestamp::now();
    let t0 = tokio::time::Instant::now();
    Arc::new(move || {
        let elapsed = jiff::SignedDuration::try_from(t0.elapsed()).unwrap();
        base.checked_add(elapsed).unwrap()
    })
}

// ---- Fixtures ----------------------------------------------------------------------------

fn config() -> Arc<ValidConfig> {
    Arc::new(crate::config::parse(CONFIG, "controller-test.yaml", Path::new("/")).unwrap())
}

/// A Proxy as the API server holds it after the controller added its finalizer.
fn proxy() -> Proxy {
    let mut p = Proxy::new(
        NAME,
        ProxySpec {
            provider: "kvm2".into(),
            ..Default::default()
        },
    );
    p.metadata.namespace = Some(NS.into());
    p.metadata.uid = Some(UID.into());
    p.metadata.generation = Some(GENERATION);
    p.metadata.resource_version = Some("41".into());
    p.metadata.finalizers = Some(vec![FINALIZER.into()]);
    p
}

fn with_user_data(mut p: Proxy) -> Proxy {
    p.spec.user_data = Some(UserDataSource {
        secret_ref: SecretKeyRef {
            name: SECRET_NAME.into(),
            key: SECRET_KEY.into(),
        },
    });
    p
}

fn deleting(mut p: Proxy) -> Proxy {
    p.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::now()));
    p
}

fn user_data_secret() -> Secret {
    let mut s = Secret::default();
    s.metadata.name = Some(SECRET_NAME.into());
    s.metadata.namespace = Some(NS.into());
    s.metadata.labels = Some([(USER_DATA_LABEL.to_string(), "true".to_string())].into());
    s.data = Some(
        [
            (SECRET_KEY.to_string(), ByteString(USER_DATA.to_vec())),
            ("other".to_string(), ByteString(b"unrelated".to_vec())),
        ]
        .into(),
    );
    s
}

fn owner(uid: &str) -> ProxyRef {
    ProxyRef {
        namespace: NS.into(),
        name: NAME.into(),
        uid: uid.into(),
    }
}

/// The name the fake (like kvm2) gives this Proxy's instance.
fn our_name() -> String {
    format!("{}{UID}", crate::instance::NAME_PREFIX)
}

fn id(host: &str, name: &str) -> InstanceId {
    InstanceId {
        host: host.into(),
        name: name.into(),
    }
}

fn instance(id: InstanceId, uid: &str, state: InstanceState, address: Option<&str>) -> Instance {
    Instance {
        id,
        proxy: owner(uid),
        state,
        addresses: address.map(|a| a.parse().unwrap()).into_iter().collect(),
        address_source: address.map(|_| crate::provider::AddressOrigin::Agent),
        seed_applied: None,
        created_at: "2026-01-01T00:00:00Z".into(),
    }
}

/// Long ago: a transition time a fresh write must not keep (or must keep) visibly.
fn long_ago() -> jiff::Timestamp {
    jiff::Timestamp::from_second(1_600_000_000).unwrap()
}

const LONG_AGO: &str = "2020-09-13T12:26:40Z";

/// What the controller concludes about `i`'s proxy when it serves.
fn check_of(i: &Instance) -> serving::Check {
    let (serving, reason, message) = match (i.state, i.addresses.first()) {
        (InstanceState::Running, Some(a)) => (
            true,
            "Serving",
            format!("{a}:3128 answered CONNECT 0.0.0.0:0 with 200 in 0 ms"),
        ),
        (InstanceState::Running, None) => (
            false,
            "NoAddress",
            "the instance reports no address to probe".to_string(),
        ),
        (state, _) => (false, "NotRunning", format!("instance is {state}")),
    };
    serving::Check {
        serving,
        reason,
        message,
        running: i.state == InstanceState::Running,
    }
}

/// The status a reconcile wrote when it last saw `i` (long ago), its proxy serving.
fn status_seeing(i: &Instance) -> ProxyStatus {
    status::observed(
        &ProxyStatus::default(),
        Some(GENERATION),
        i,
        &check_of(i),
        long_ago(),
    )
}

/// The same, as an operator that did not probe yet wrote it: no `Serving` condition.
fn status_before_probes(i: &Instance) -> ProxyStatus {
    let mut s = status_seeing(i);
    s.conditions.retain(|c| c.type_ != status::SERVING);
    s
}

fn with_status(mut p: Proxy, s: ProxyStatus) -> Proxy {
    p.status = Some(s);
    p
}

/// One scenario's world: the context, the fake provider and the timeline.
struct World {
    ctx: Arc<Context>,
    fake: Arc<FakeProvider>,
    timeline: Timeline,
    proxies: Proxies,
}

impl World {
    fn new(proxy: &Proxy) -> Self {
        Self::build(proxy, &[], None)
    }

    fn build(proxy: &Proxy, secrets: &[Secret], answer: Option<Override>) -> Self {
        let timeline = Timeline::default();
        let client = api_server(proxy, secrets, answer, timeline.clone());
        let fake = Arc::new(FakeProvider::named("kvm2", &["h1", "h2"]));
        let mut registry = Registry::new();
        registry.insert(Arc::new(Logged {
            inner: fake.clone(),
            timeline: timeline.clone(),
        }));
        let mut ctx = Context::new(
            client,
            config(),
            Arc::new(registry),
            ControllerMetrics::default(),
            Some("egress-operator-0".into()),
        );
        // The middle of the jitter band: delays are exactly the ladder's.
        ctx.jitter = || 0.5;
        let proxies = Proxies::default();
        proxies.install(&mut ctx);
        Self {
            ctx: Arc::new(ctx),
            fake,
            timeline,
            proxies,
        }
    }

    /// Reconciles as the Controller does when the Proxy's requeue delay has run out (the
    /// tests here reconcile one Proxy several times without waiting for it).
    async fn reconcile(&self, proxy: &Proxy) -> Result<Action, ControllerError> {
        if let Some(uid) = proxy.uid() {
            self.ctx.attempts.expire(&uid);
        }
        self.trigger(proxy).await
    }

    /// Reconciles as the Controller does on a watch event: before the requeue delay ran
    /// out, unless the event changed something that justifies it.
    async fn trigger(&self, proxy: &Proxy) -> Result<Action, ControllerError> {
        guard(reconcile(Arc::new(proxy.clone()), self.ctx.clone())).await
    }

    /// Reconciles and, on failure, asks the error policy, as the Controller does.
    async fn reconcile_err(&self, proxy: &Proxy) -> (ControllerError, Action) {
        let e = self
            .reconcile(proxy)
            .await
            .expect_err("the reconcile should have failed");
        let action = error_policy(Arc::new(proxy.clone()), &e, self.ctx.clone());
        (e, action)
    }

    fn labels(&self) -> Vec<String> {
        self.timeline.labels()
    }
}

async fn guard<F: Future>(f: F) -> F::Output {
    match tokio::time::timeout(HANG_GUARD, f).await {
        Ok(out) => out,
        Err(_) => panic!("the reconcile hung: a request was never answered"),
    }
}

fn labels(l: &[&str]) -> Vec<String> {
    l.iter().map(ToString::to_string).collect()
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status:#}"))
}

fn requeue(secs: u64) -> Action {
    Action::requeue(Duration::from_secs(secs))
}

/// Every status apply is a forced server-side apply of the status alone, by our manager.
fn assert_status_applies_are_ssa(t: &Timeline) {
    let applies: Vec<Seen> = t
        .requests()
        .into_iter()
        .filter(Seen::is_status_apply)
        .collect();
    assert!(!applies.is_empty(), "no status apply");
    for a in applies {
        assert_eq!(
            a.query.get("fieldManager").map(String::as_str),
            Some(FIELD_MANAGER),
            "{a:?}"
        );
        assert_eq!(
            a.query.get("force").map(String::as_str),
            Some("true"),
            "{a:?}"
        );
        assert_eq!(a.content_type, "application/apply-patch+yaml", "{a:?}");
        assert_eq!(
            a.query.get("fieldValidation").map(String::as_str),
            Some("Strict"),
            "a field the installed CRD lacks must be refused, not pruned: {a:?}"
        );
        assert_eq!(a.body["apiVersion"], "egress-operator.dev/v1alpha1");
        assert_eq!(a.body["kind"], "Proxy");
        let keys: Vec<&String> = a.body.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["apiVersion", "kind", "status"],
            "a status apply must carry nothing but the status: {a:?}"
        );
    }
}

/// Events are about our Proxy and come from our controller.
fn assert_events_regard_the_proxy(t: &Timeline) {
    for e in t.events() {
        assert_eq!(e["regarding"]["kind"], "Proxy", "{e:#}");
        assert_eq!(e["regarding"]["name"], NAME, "{e:#}");
        assert_eq!(e["regarding"]["namespace"], NS, "{e:#}");
        assert_eq!(e["regarding"]["uid"], UID, "{e:#}");
        assert_eq!(e["reportingController"], "egress-operator", "{e:#}");
        assert_eq!(e["reportingInstance"], "egress-operator-0", "{e:#}");
    }
}

/// The Secret's content is in no request the controller sent (status, events, ...).
fn assert_no_secret_in_requests(t: &Timeline) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(USER_DATA);
    for r in t.requests() {
        let text = r.body.to_string();
        assert!(!text.contains(LEAK_MARKER), "user-data leaked into {r:?}");
        assert!(!text.contains(&b64), "user-data (base64) leaked into {r:?}");
    }
}

// ---- 1. Finalizer ------------------------------------------------------------------------

#[tokio::test]
async fn a_new_proxy_gets_the_finalizer_and_nothing_else() {
    let mut p = proxy();
    p.metadata.finalizers = None;
    let w = World::new(&p);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, Action::await_change());
    assert_eq!(w.labels(), labels(&["finalizer:add"]));
    let patch = &w.timeline.finalizer_patches()[0];
    assert_eq!(patch.content_type, "application/json-patch+json");
    assert_eq!(
        patch.body,
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
        ])
    );
    assert!(w.fake.calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(w.ctx.metrics.reconciles("ok"), 1);
}

#[tokio::test]
async fn the_finalizer_is_appended_to_other_finalizers() {
    let mut p = proxy();
    p.metadata.finalizers = Some(vec!["example.org/keep".into()]);
    let w = World::new(&p);

    w.reconcile(&p).await.unwrap();

    assert_eq!(w.labels(), labels(&["finalizer:add"]));
    assert_eq!(
        w.timeline.finalizer_patches()[0].body,
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": ["example.org/keep"]},
            {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
        ])
    );
    assert!(w.fake.calls().is_empty());
}

#[tokio::test]
async fn a_deleted_proxy_without_our_finalizer_is_left_alone() {
    let mut p = deleting(proxy());
    p.metadata.finalizers = Some(vec!["example.org/keep".into()]);
    let w = World::new(&p);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, Action::await_change());
    assert!(w.labels().is_empty(), "{:?}", w.labels());
    assert!(w.fake.calls().is_empty());
}

#[tokio::test]
async fn a_failed_finalizer_patch_is_a_transient_kubernetes_error() {
    let mut p = proxy();
    p.metadata.finalizers = None;
    let w = World::build(
        &p,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_finalizer_patch()
                .then(|| (500, status_error(500, "InternalError", "etcd is away")))
        })),
    );

    let (e, action) = w.reconcile_err(&p).await;

    assert!(matches!(e, ControllerError::Kube(_)), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, requeue(5));
    assert!(w.fake.calls().is_empty());
}

// ---- 2. Create ---------------------------------------------------------------------------

#[tokio::test]
async fn create_reads_the_user_data_creates_and_reports_the_instance() {
    let p = with_user_data(proxy());
    let w = World::build(&p, &[user_data_secret()], None);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&[
            "status:Provisioning",
            "secret:proxy-ud",
            "provider:create",
            "status:Running",
            "event:Normal:Created",
        ])
    );
    // Serving: probed again every serving.periodSeconds.
    assert_eq!(action, requeue(30));
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(u64::from(
            w.ctx.config.serving.period_seconds
        )))
    );
    assert_status_applies_are_ssa(&w.timeline);
    assert_events_regard_the_proxy(&w.timeline);

    // Provisioning first: nothing known yet, both conditions False with reason Creating.
    let statuses = w.timeline.statuses();
    let first = &statuses[0];
    assert_eq!(first["phase"], "Provisioning");
    assert_eq!(first["observedGeneration"], GENERATION);
    for c in ["Provisioned", "Ready"] {
        assert_eq!(condition(first, c)["status"], "False");
        assert_eq!(condition(first, c)["reason"], "Creating");
    }
    assert!(first.get("instanceId").is_none(), "{first:#}");

    // Then the instance, whole.
    let name = our_name();
    let s = &statuses[1];
    assert_eq!(s["phase"], "Running");
    assert_eq!(s["instanceId"], format!("h1/{name}"));
    assert_eq!(s["host"], "h1");
    assert_eq!(s["instanceState"], "running");
    assert_eq!(s["address"], FAKE_ADDRESS);
    assert_eq!(s["addresses"], json!([FAKE_ADDRESS]));
    assert_eq!(s["observedGeneration"], GENERATION);
    assert!(s.get("lastErrorClass").is_none(), "{s:#}");
    let provisioned = condition(s, "Provisioned");
    assert_eq!(provisioned["status"], "True");
    assert_eq!(provisioned["reason"], "InstanceExists");
    assert_eq!(provisioned["observedGeneration"], GENERATION);
    let ready = condition(s, "Ready");
    assert_eq!(ready["status"], "True");
    assert_eq!(ready["reason"], "Serving");
    assert_eq!(ready["message"], format!("serving at {FAKE_ADDRESS}"));
    let serving = condition(s, "Serving");
    assert_eq!(serving["status"], "True");
    assert_eq!(serving["reason"], "Serving");
    let message = serving["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "{FAKE_ADDRESS}:3128 answered CONNECT 0.0.0.0:0 with 200 in "
        )) && message.ends_with(" ms"),
        "{message}"
    );
    assert_eq!(w.proxies.dials(), 1);
    assert_eq!(w.ctx.metrics.probes.outcomes("Serving"), 1);

    // One event for the reconcile: Created names the instance and, since it served at
    // once, the address (no separate Ready event: one write fewer per Proxy).
    assert_eq!(
        w.timeline.event_summary(),
        vec![(
            "Normal".into(),
            "Created".into(),
            format!("created instance h1/{name}, ready at {FAKE_ADDRESS}")
        )]
    );

    // The provider got the Secret's bytes, for this Proxy.
    let reqs = w.fake.create_requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].proxy, owner(UID));
    assert_eq!(reqs[0].spec, p.spec);
    assert_eq!(
        reqs[0].user_data.as_ref().map(UserData::expose),
        Some(USER_DATA)
    );
    assert_eq!(w.fake.calls(), vec!["create"]);
    assert_eq!(w.fake.instances().len(), 1);
    // ... and nothing else did.
    assert_no_secret_in_requests(&w.timeline);

    assert_eq!(w.ctx.metrics.instances("created"), 1);
    assert_eq!(w.ctx.metrics.reconciles("ok"), 1);
}

#[tokio::test]
async fn create_without_user_data_reads_no_secret() {
    let p = proxy();
    let w = World::new(&p);

    w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&[
            "status:Provisioning",
            "provider:create",
            "status:Running",
            "event:Normal:Created",
        ])
    );
    assert!(w.fake.create_requests()[0].user_data.is_none());
}

#[tokio::test]
async fn a_create_pinned_to_a_host_lands_there() {
    let mut p = proxy();
    p.spec.host = Some("h2".into());
    let w = World::new(&p);

    w.reconcile(&p).await.unwrap();

    let s = w.timeline.last_status();
    assert_eq!(s["host"], "h2");
    assert_eq!(s["instanceId"], format!("h2/{}", our_name()));
}

#[tokio::test]
async fn a_retried_create_does_not_mark_provisioning_again() {
    // The first attempt wrote Provisioning and then failed; the retry goes straight on.
    let p = with_status(
        proxy(),
        status::provisioning(
            &ProxyStatus::default(),
            Some(GENERATION),
            "Creating",
            "creating the instance",
            long_ago(),
        ),
    );
    let w = World::new(&p);

    w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&["provider:create", "status:Running", "event:Normal:Created",])
    );
    // Ready flipped False -> True: its transition time moves.
    let ready = condition(&w.timeline.last_status(), "Ready").clone();
    assert_ne!(ready["lastTransitionTime"], LONG_AGO, "{ready:#}");
}

#[tokio::test]
async fn events_that_cannot_be_published_do_not_fail_the_reconcile() {
    let p = proxy();
    let w = World::build(
        &p,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_event()
                .then(|| (403, status_error(403, "Forbidden", "no events for you")))
        })),
    );

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, requeue(30));
    assert_eq!(w.timeline.last_status()["phase"], "Running");
    assert_eq!(w.timeline.events().len(), 1, "the event was attempted");
    assert_eq!(w.ctx.metrics.events_failed(), 1, "and counted");
}

// ---- 3. Refresh --------------------------------------------------------------------------

#[tokio::test]
async fn a_running_instance_is_only_refreshed() {
    let running = instance(
        id("h2", &our_name()),
        UID,
        InstanceState::Running,
        Some("198.51.100.4"),
    );
    // User-data is set, but a refresh has no reason to read it. The status is one an
    // operator wrote before it probed: the probe adds `Serving`, so it is written.
    let p = with_status(with_user_data(proxy()), status_before_probes(&running));
    let w = World::build(&p, &[user_data_secret()], None);
    w.fake.insert(running.clone());

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(w.labels(), labels(&["provider:get", "status:Running"]));
    assert_eq!(w.fake.calls(), vec!["get"]);
    assert!(w.fake.create_requests().is_empty());
    assert!(w.timeline.events().is_empty(), "{:?}", w.timeline.events());
    assert_eq!(action, requeue(30));
    let s = w.timeline.last_status();
    assert_eq!(s["instanceId"], format!("h2/{}", our_name()));
    assert_eq!(s["address"], "198.51.100.4");
    // Ready stayed True: its transition time is the old one.
    assert_eq!(condition(&s, "Ready")["lastTransitionTime"], LONG_AGO);
    assert_eq!(condition(&s, "Provisioned")["lastTransitionTime"], LONG_AGO);
    assert_eq!(condition(&s, "Serving")["status"], "True");
    assert_eq!(w.ctx.metrics.instances("created"), 0);
    assert_status_applies_are_ssa(&w.timeline);

    // The next probe of the steady proxy: no provider call (it served and was fetched
    // moments ago), no status write (only the latency could differ).
    let echoed = after_our_write(&p, &w);
    w.timeline.clear();
    let action = w.reconcile(&echoed).await.unwrap();
    assert!(w.labels().is_empty(), "{:?}", w.labels());
    assert_eq!(w.fake.calls(), vec!["get"], "no second get");
    assert_eq!(w.proxies.dials(), 2, "probed again");
    assert_eq!(action, requeue(30));
}

#[tokio::test(start_paused = true)]
async fn a_serving_proxy_is_fetched_again_after_the_refresh_period_and_after_a_failed_probe() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running.clone());

    w.reconcile(&p).await.unwrap();
    tokio::time::advance(Duration::from_secs(30)).await;
    w.reconcile(&p).await.unwrap();
    assert_eq!(w.fake.calls(), vec!["get"], "the cached instance is fresh");
    tokio::time::advance(w.ctx.policy.ready_refresh).await;
    w.reconcile(&p).await.unwrap();
    assert_eq!(
        w.fake.calls(),
        vec!["get", "get"],
        "refreshed after ready_refresh"
    );

    // A failed probe: the next reconcile asks the provider (the VM may be gone).
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    w.reconcile(&p).await.unwrap();
    assert_eq!(w.fake.calls(), vec!["get", "get"]);
    w.reconcile(&p).await.unwrap();
    assert_eq!(w.fake.calls(), vec!["get", "get", "get"]);
    assert_eq!(w.proxies.dials(), 5);
}

#[tokio::test]
async fn a_refresh_that_finds_the_address_reports_ready_once() {
    let no_address = instance(id("h1", &our_name()), UID, InstanceState::Running, None);
    let p = with_status(proxy(), status_before_probes(&no_address));
    let w = World::new(&p);
    w.fake.insert(no_address.clone());

    // Running without an address: not ready, looked at again soon.
    let action = w.reconcile(&p).await.unwrap();
    assert_eq!(action, requeue(15));
    assert_eq!(action, Action::requeue(w.ctx.policy.not_ready_refresh));
    let s = w.timeline.last_status();
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(condition(&s, "Ready")["reason"], "WaitingForAddress");
    assert!(w.timeline.events().is_empty());

    // The address shows up: Ready, one Ready event, the slow refresh.
    w.timeline.clear();
    w.fake.insert(instance(
        no_address.id.clone(),
        UID,
        InstanceState::Running,
        Some("192.0.2.99"),
    ));
    let action = w.reconcile(&p).await.unwrap();
    assert_eq!(action, requeue(30));
    assert_eq!(
        w.labels(),
        labels(&["provider:get", "status:Running", "event:Normal:Ready"])
    );
    assert_eq!(
        w.timeline.event_summary()[0].2,
        "ready at 192.0.2.99".to_string()
    );
}

#[tokio::test]
async fn a_paused_instance_is_degraded_not_replaced() {
    let paused = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Paused,
        Some(FAKE_ADDRESS),
    );
    let running = instance(
        paused.id.clone(),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(paused);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(w.labels(), labels(&["provider:get", "status:Degraded"]));
    assert_eq!(w.fake.calls(), vec!["get"]);
    assert_eq!(action, requeue(15));
    let s = w.timeline.last_status();
    assert_eq!(s["instanceState"], "paused");
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(condition(&s, "Ready")["reason"], "NotRunning");
    assert_eq!(condition(&s, "Provisioned")["status"], "True");
}

#[tokio::test]
async fn a_transient_get_failure_keeps_the_instance_and_creates_nothing() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running);
    w.fake.set_down("h1", true);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, requeue(5));
    assert_eq!(w.fake.calls(), vec!["get"]);
    assert_eq!(
        w.labels(),
        labels(&[
            "provider:get",
            "status:Running",
            "event:Warning:ProviderError"
        ])
    );
    let s = w.timeline.last_status();
    // What was known stays; Ready says why it is not trusted now.
    assert_eq!(s["instanceId"], format!("h1/{}", our_name()));
    assert_eq!(s["lastErrorClass"], "transient");
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(condition(&s, "Ready")["reason"], "ProviderError");
    assert_eq!(condition(&s, "Provisioned")["status"], "True");
}

// ---- 4. Replace a lost instance ----------------------------------------------------------

#[tokio::test]
async fn a_lost_instance_is_replaced() {
    let lost = instance(
        id("h2", "egress-old"),
        UID,
        InstanceState::Running,
        Some("198.51.100.4"),
    );
    let p = with_status(with_user_data(proxy()), status_seeing(&lost));
    let w = World::build(&p, &[user_data_secret()], None);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&[
            "provider:get",
            "status:Provisioning",
            "event:Warning:InstanceLost",
            "secret:proxy-ud",
            "provider:create",
            "status:Running",
            "event:Normal:Replaced",
        ])
    );
    assert_eq!(action, requeue(30));
    let name = our_name();
    let events = w.timeline.event_summary();
    assert_eq!(
        events[0].2,
        "instance h2/egress-old is gone; creating a new one"
    );
    assert_eq!(
        events[1].2,
        format!("replaced a lost instance with instance h1/{name}, ready at {FAKE_ADDRESS}")
    );
    // While replacing, status shows no address of the lost instance.
    let statuses = w.timeline.statuses();
    assert!(statuses[0].get("address").is_none(), "{:#}", statuses[0]);
    assert_eq!(condition(&statuses[0], "Ready")["reason"], "Replacing");
    let s = &statuses[1];
    assert_eq!(s["instanceId"], format!("h1/{name}"));
    assert_eq!(s["address"], FAKE_ADDRESS);
    assert_eq!(condition(s, "Ready")["status"], "True");
    // Ready went False while replacing and True again: the transition time moved.
    assert_ne!(condition(s, "Ready")["lastTransitionTime"], LONG_AGO);
    assert_eq!(
        w.fake.create_requests()[0]
            .user_data
            .as_ref()
            .map(UserData::expose),
        Some(USER_DATA)
    );
    assert_eq!(w.ctx.metrics.instances("replaced-lost"), 1);
    assert_eq!(w.ctx.metrics.instances("created"), 0);
    assert_no_secret_in_requests(&w.timeline);
    assert_events_regard_the_proxy(&w.timeline);
}

#[tokio::test]
async fn a_failed_replacement_does_not_advertise_the_lost_address() {
    let lost = instance(
        id("h2", "egress-old"),
        UID,
        InstanceState::Running,
        Some("198.51.100.4"),
    );
    let p = with_status(proxy(), status_seeing(&lost));
    let w = World::new(&p);
    w.fake.fail_next("create", ErrorClass::Transient);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, requeue(5));
    let s = w.timeline.last_status();
    assert_eq!(s["lastErrorClass"], "transient");
    assert!(
        s.get("address").is_none() && s.get("addresses").is_none(),
        "the lost instance's address is still advertised: {s:#}"
    );
    assert_ne!(s["phase"], "Running", "{s:#}");
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(condition(&s, "Ready")["reason"], "ProviderError");
}

// ---- 5. Replace a failed instance --------------------------------------------------------

#[tokio::test]
async fn a_crashed_instance_is_deleted_then_replaced() {
    let crashed = instance(id("h2", &our_name()), UID, InstanceState::Crashed, None);
    let was_running = instance(
        crashed.id.clone(),
        UID,
        InstanceState::Running,
        Some("198.51.100.4"),
    );
    let p = with_status(proxy(), status_seeing(&was_running));
    let w = World::new(&p);
    w.fake.insert(crashed);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&[
            "provider:get",
            "status:Provisioning",
            "event:Warning:InstanceFailed",
            "provider:delete",
            "provider:create",
            "status:Running",
            "event:Normal:Replaced",
        ])
    );
    assert_eq!(action, requeue(30));
    let name = our_name();
    let events = w.timeline.event_summary();
    assert_eq!(
        events[0].2,
        format!("instance h2/{name} is crashed; replacing it")
    );
    assert_eq!(
        events[1].2,
        format!("replaced a failed instance with instance h1/{name}, ready at {FAKE_ADDRESS}")
    );
    // The crashed domain is gone; the new one runs (the fake places it on h1).
    let left = w.fake.instances();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].id, id("h1", &name));
    assert_eq!(left[0].state, InstanceState::Running);
    assert_eq!(w.timeline.last_status()["instanceId"], format!("h1/{name}"));
    assert_eq!(w.ctx.metrics.instances("replaced-failed"), 1);
}

#[tokio::test]
async fn a_shut_off_instance_is_replaced_too() {
    let off = instance(id("h1", &our_name()), UID, InstanceState::ShutOff, None);
    let p = with_status(proxy(), status_seeing(&off));
    let w = World::new(&p);
    w.fake.insert(off);

    w.reconcile(&p).await.unwrap();

    assert_eq!(w.fake.calls(), vec!["get", "delete", "create"]);
    assert!(
        w.labels()
            .contains(&"event:Warning:InstanceFailed".to_string())
    );
    assert_eq!(w.fake.instances()[0].state, InstanceState::Running);
}

#[tokio::test]
async fn a_failed_delete_of_the_crashed_instance_stops_before_create() {
    let crashed = instance(id("h1", &our_name()), UID, InstanceState::Crashed, None);
    let p = with_status(proxy(), status_seeing(&crashed));
    let w = World::new(&p);
    w.fake.insert(crashed);
    w.fake.fail_next("delete", ErrorClass::Transient);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, requeue(5));
    assert_eq!(w.fake.calls(), vec!["get", "delete"]);
    assert!(w.fake.create_requests().is_empty());
}

// ---- 6. Delete ---------------------------------------------------------------------------

#[tokio::test]
async fn delete_removes_the_instance_then_the_finalizer() {
    let running = instance(
        id("h2", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let mut p = deleting(with_status(proxy(), status_seeing(&running)));
    // Our finalizer second: the removal must name its index.
    p.metadata.finalizers = Some(vec!["example.org/keep".into(), FINALIZER.into()]);
    let w = World::new(&p);
    w.fake.insert(running);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, Action::await_change());
    assert_eq!(
        w.labels(),
        labels(&[
            "status:Deleting",
            "provider:delete",
            "provider:list",
            "event:Normal:Deleted",
            "finalizer:remove",
        ])
    );
    assert!(w.fake.instances().is_empty());
    assert_eq!(
        w.timeline.event_summary()[0].2,
        format!("deleted h2/{}", our_name())
    );
    let patch = &w.timeline.finalizer_patches()[0];
    assert_eq!(patch.content_type, "application/json-patch+json");
    assert_eq!(
        patch.body,
        json!([
            {"op": "test", "path": "/metadata/finalizers/1", "value": FINALIZER},
            {"op": "remove", "path": "/metadata/finalizers/1"},
        ])
    );
    let s = &w.timeline.statuses()[0];
    assert_eq!(condition(s, "Ready")["status"], "False");
    assert_eq!(condition(s, "Ready")["reason"], "Deleting");
    assert_eq!(w.ctx.metrics.instances("deleted"), 1);
    assert_status_applies_are_ssa(&w.timeline);
    assert_events_regard_the_proxy(&w.timeline);
}

#[tokio::test]
async fn a_reconcile_behind_the_finalizer_removal_does_nothing() {
    let running = instance(id("h2", &our_name()), UID, InstanceState::Running, None);
    let p = deleting(with_status(proxy(), status_seeing(&running)));
    let w = World::new(&p);
    w.fake.insert(running);
    w.reconcile(&p).await.unwrap();
    assert_eq!(w.timeline.finalizer_patches().len(), 1);
    w.timeline.clear();

    // Our own Deleting status write queued a second reconcile; the cache has not yet seen
    // the finalizer go, so it hands over the same object.
    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, Action::await_change());
    assert_eq!(
        w.labels(),
        Vec::<String>::new(),
        "no status patch, no listing, no second Deleted event, no 404"
    );
    assert_eq!(
        w.fake.calls(),
        vec!["delete", "list"],
        "only the first cleanup's"
    );
}

#[tokio::test]
async fn a_finalizer_removal_told_404_is_done() {
    let p = deleting(proxy());
    let w = World::build(
        &p,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_finalizer_patch().then(|| {
                (
                    404,
                    status_error(404, "NotFound", "proxies \"p\" not found"),
                )
            })
        })),
    );

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, Action::await_change());
    assert_eq!(w.ctx.metrics.reconciles("ok"), 1);
    // Remembered as released: a stale copy runs nothing more.
    w.timeline.clear();
    w.reconcile(&p).await.unwrap();
    assert!(w.labels().is_empty(), "{:?}", w.labels());
}

#[tokio::test]
async fn delete_of_a_proxy_that_never_got_an_instance_just_lets_it_go() {
    let p = deleting(proxy());
    let w = World::new(&p);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, Action::await_change());
    assert_eq!(
        w.labels(),
        labels(&[
            "status:Deleting",
            "provider:list",
            "event:Normal:Deleted",
            "finalizer:remove",
        ])
    );
    assert_eq!(w.fake.calls(), vec!["list"]);
    assert_eq!(w.timeline.event_summary()[0].2, "no instance existed");
    assert_eq!(w.ctx.metrics.instances("deleted"), 0);
}

#[tokio::test]
async fn delete_finds_an_instance_status_never_named_by_uid() {
    // The operator died after the Create and before the status write.
    let p = deleting(with_status(
        proxy(),
        status::provisioning(
            &ProxyStatus::default(),
            Some(GENERATION),
            "Creating",
            "creating the instance",
            long_ago(),
        ),
    ));
    let w = World::new(&p);
    let ours = instance(
        id("h2", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let someone_elses = instance(
        id("h1", "egress-other"),
        "5b0c7e4e-0000-4000-8000-00000000b002",
        InstanceState::Running,
        None,
    );
    w.fake.insert(ours);
    w.fake.insert(someone_elses.clone());

    w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&[
            "status:Deleting",
            "provider:list",
            "provider:delete",
            "event:Normal:Deleted",
            "finalizer:remove",
        ])
    );
    assert_eq!(w.fake.instances(), vec![someone_elses]);
    assert_eq!(
        w.timeline.event_summary()[0].2,
        format!("deleted h2/{}", our_name())
    );
}

#[tokio::test]
async fn delete_that_fails_transiently_keeps_the_finalizer_and_retries() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = deleting(with_status(proxy(), status_seeing(&running)));
    let w = World::new(&p);
    w.fake.insert(running.clone());
    w.fake.fail_next("delete", ErrorClass::Transient);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Transient);
    assert!(matches!(e, ControllerError::Provider(_)), "{e:?}");
    assert_eq!(action, requeue(5));
    assert_eq!(w.labels(), labels(&["status:Deleting", "provider:delete"]));
    assert!(w.timeline.finalizer_patches().is_empty());
    assert_eq!(w.fake.instances(), vec![running]);
    assert_eq!(w.ctx.metrics.reconciles("transient"), 1);

    // The retry finishes the job.
    w.timeline.clear();
    w.reconcile(&p).await.unwrap();
    assert!(w.fake.instances().is_empty());
    assert_eq!(w.timeline.finalizer_patches().len(), 1);
}

#[tokio::test]
async fn an_instance_that_is_not_ours_to_delete_does_not_block_the_proxy() {
    let running = instance(id("h1", &our_name()), UID, InstanceState::Running, None);
    let p = deleting(with_status(proxy(), status_seeing(&running)));
    let w = World::new(&p);
    w.fake.insert(running);
    w.fake.fail_next("delete", ErrorClass::Permanent);

    w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.labels(),
        labels(&[
            "status:Deleting",
            "provider:delete",
            "event:Warning:NotDeleted",
            "provider:list",
            "event:Normal:Deleted",
            "finalizer:remove",
        ])
    );
}

/// A status that names another Proxy's instance (a stale or edited status) must not make
/// this Proxy's deletion remove it: the delete goes through the mark.
#[tokio::test]
async fn deletion_leaves_an_instance_whose_mark_names_another_proxy() {
    let other_uid = "0badc0de-0000-4000-8000-00000000beef";
    let theirs = instance(
        id("h1", "egress-theirs"),
        other_uid,
        InstanceState::Running,
        None,
    );
    let p = deleting(with_status(proxy(), status_seeing(&theirs)));
    let w = World::new(&p);
    w.fake.insert(theirs.clone());

    w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.fake.instances(),
        vec![theirs],
        "the other Proxy's instance is untouched"
    );
    let labels_seen = w.labels();
    assert!(
        labels_seen.contains(&"event:Warning:NotDeleted".to_string()),
        "{labels_seen:?}"
    );
}

#[tokio::test]
async fn a_failed_deleting_status_does_not_stop_the_delete() {
    let running = instance(id("h1", &our_name()), UID, InstanceState::Running, None);
    let p = deleting(with_status(proxy(), status_seeing(&running)));
    let w = World::build(
        &p,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_status_apply()
                .then(|| (409, status_error(409, "Conflict", "the object changed")))
        })),
    );
    w.fake.insert(running);

    w.reconcile(&p).await.unwrap();

    assert!(w.fake.instances().is_empty());
    assert_eq!(w.timeline.finalizer_patches().len(), 1);
}

// ---- 7. Error classes --------------------------------------------------------------------

#[tokio::test]
async fn a_transient_create_failure_is_recorded_and_backs_off() {
    let p = proxy();
    let w = World::new(&p);
    w.fake.fail_next("create", ErrorClass::Transient);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(e.reason(), "ProviderError");
    assert_eq!(action, requeue(5));
    assert_eq!(
        w.labels(),
        labels(&[
            "status:Provisioning",
            "provider:create",
            "status:Provisioning",
            "event:Warning:ProviderError",
        ])
    );
    let s = w.timeline.last_status();
    assert_eq!(s["lastErrorClass"], "transient");
    assert_eq!(s["observedGeneration"], GENERATION);
    let ready = condition(&s, "Ready");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "ProviderError");
    assert_eq!(ready["message"], "provider: injected create failure");
    assert_eq!(condition(&s, "Provisioned")["status"], "False");
    assert_eq!(
        w.timeline.event_summary()[0].2,
        "provider: injected create failure"
    );
    assert_eq!(w.ctx.metrics.reconciles("transient"), 1);
    assert_eq!(w.ctx.metrics.instances("created"), 0);

    // Fails again: the delay doubles; the same error is not announced again.
    w.timeline.clear();
    let p = with_status(p, serde_json::from_value(s).unwrap());
    w.fake.fail_next("create", ErrorClass::Transient);
    let (_, action) = w.reconcile_err(&p).await;
    assert_eq!(action, requeue(10));
    assert_eq!(
        w.labels(),
        labels(&["provider:create", "status:Provisioning"])
    );

    // A third time: 20 s.
    w.fake.fail_next("create", ErrorClass::Transient);
    let (_, action) = w.reconcile_err(&p).await;
    assert_eq!(action, requeue(20));

    // A success forgets the failures: the next one starts over at 5 s. (Its proxy does
    // not answer yet, so the next reconcile asks the provider again.)
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    w.reconcile(&p).await.unwrap();
    w.fake.fail_next("get", ErrorClass::Transient);
    let p = with_status(p, serde_json::from_value(w.timeline.last_status()).unwrap());
    let (_, action) = w.reconcile_err(&p).await;
    assert_eq!(action, requeue(5));
}

#[tokio::test]
async fn jitter_spreads_the_retry_within_its_band() {
    let p = proxy();
    let mut w = World::new(&p);
    Arc::get_mut(&mut w.ctx).unwrap().jitter = || 0.0;
    w.fake.fail_next("create", ErrorClass::Transient);

    let (_, action) = w.reconcile_err(&p).await;

    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(4)),
        "5 s - 20 %"
    );
}

#[tokio::test]
async fn a_quota_failure_retries_on_the_slow_ladder() {
    let p = proxy();
    let w = World::new(&p);
    w.fake.fail_next("create", ErrorClass::Quota);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Quota);
    assert_eq!(action, requeue(120));
    let s = w.timeline.last_status();
    assert_eq!(s["lastErrorClass"], "quota");
    assert_eq!(condition(&s, "Ready")["reason"], "CapacityExceeded");
    assert_eq!(
        w.timeline.event_summary()[0].1,
        "CapacityExceeded".to_string()
    );
    let (_, again) = {
        w.fake.fail_next("create", ErrorClass::Quota);
        w.reconcile_err(&p).await
    };
    assert_eq!(again, requeue(240));
}

#[tokio::test]
async fn a_spec_the_config_cannot_serve_fails_permanently_without_calling_the_provider() {
    let mut p = proxy();
    p.spec.machine_type = Some("huge".into());
    let w = World::new(&p);

    let (e, action) = w.reconcile_err(&p).await;

    assert!(matches!(e, ControllerError::InvalidSpec(_)), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Permanent);
    assert_eq!(action, requeue(3600));
    assert_eq!(action, Action::requeue(w.ctx.policy.permanent));
    assert!(w.fake.calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(
        w.labels(),
        labels(&["status:Failed", "event:Warning:InvalidSpec"])
    );
    let s = w.timeline.last_status();
    assert_eq!(s["phase"], "Failed");
    assert_eq!(s["lastErrorClass"], "permanent");
    let ready = condition(&s, "Ready");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "InvalidSpec");
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.contains("spec.machineType") && message.contains("huge"),
        "{message}"
    );
    assert_eq!(condition(&s, "Provisioned")["reason"], "InvalidSpec");
    assert_eq!(w.ctx.metrics.reconciles("permanent"), 1);

    // No hot loop, however often it fails.
    for _ in 0..5 {
        let (_, action) = w.reconcile_err(&p).await;
        assert_eq!(action, requeue(3600));
    }
    assert!(w.fake.calls().is_empty());
}

#[tokio::test]
async fn a_host_outside_the_config_is_an_invalid_spec() {
    let mut p = proxy();
    p.spec.host = Some("h9".into());
    let w = World::new(&p);

    let (e, _) = w.reconcile_err(&p).await;

    assert_eq!(e.reason(), "InvalidSpec");
    assert!(e.to_string().contains("spec.host"), "{e}");
    assert!(w.fake.calls().is_empty());
}

#[tokio::test]
async fn a_provider_that_refuses_the_create_fails_the_proxy() {
    let p = proxy();
    let w = World::new(&p);
    w.fake.fail_next("create", ErrorClass::Permanent);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.reason(), "ProviderRefused");
    assert_eq!(action, requeue(3600));
    let s = w.timeline.last_status();
    assert_eq!(s["phase"], "Failed");
    assert_eq!(s["lastErrorClass"], "permanent");
    assert_eq!(condition(&s, "Ready")["reason"], "ProviderRefused");
}

#[tokio::test]
async fn a_missing_user_data_secret_waits_for_it_without_creating() {
    let p = with_user_data(proxy());
    let w = World::new(&p); // no Secret: the mock answers 404

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::NotFound);
    assert_eq!(e.reason(), "UserDataUnavailable");
    assert_eq!(action, requeue(30));
    assert!(w.fake.calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(
        w.labels(),
        labels(&[
            "status:Provisioning",
            "secret:proxy-ud",
            "status:Provisioning",
            "event:Warning:UserDataUnavailable",
        ])
    );
    let s = w.timeline.last_status();
    assert_eq!(s["lastErrorClass"], "notFound");
    let ready = condition(&s, "Ready");
    assert_eq!(ready["reason"], "UserDataUnavailable");
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("{NS}/{SECRET_NAME}")) && message.contains(SECRET_KEY),
        "the message must name the Secret and key: {message}"
    );
    assert_eq!(w.timeline.event_summary()[0].2, message);
    assert_eq!(w.ctx.metrics.reconciles("not_found"), 1);
}

#[tokio::test]
async fn a_user_data_secret_without_the_key_is_not_found_too() {
    let p = with_user_data(proxy());
    let mut s = user_data_secret();
    s.data.as_mut().unwrap().remove(SECRET_KEY);
    let w = World::build(&p, &[s], None);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::NotFound);
    assert_eq!(action, requeue(30));
    assert!(e.to_string().contains("no such key"), "{e}");
    assert!(w.fake.calls().is_empty());
}

/// A Proxy creator who may not read Secrets learns nothing from the Proxy about which
/// Secrets exist: a missing Secret, one that did not opt in and one without the key read
/// the same, in the error, the class, the condition and the event.
#[tokio::test]
async fn missing_unlabelled_and_keyless_secrets_read_the_same() {
    let p = with_user_data(proxy());
    let mut unlabelled = user_data_secret();
    unlabelled.metadata.labels = None;
    let mut keyless = user_data_secret();
    keyless.data.as_mut().unwrap().remove(SECRET_KEY);
    let mut seen = Vec::new();
    for secrets in [vec![], vec![unlabelled], vec![keyless]] {
        let w = World::build(&p, &secrets, None);
        let (e, action) = w.reconcile_err(&p).await;
        let s = w.timeline.last_status();
        let ready = condition(&s, "Ready");
        seen.push((
            e.to_string(),
            e.class(),
            action,
            ready["reason"].clone(),
            ready["message"].clone(),
            s["lastErrorClass"].clone(),
            w.timeline.event_summary(),
        ));
        assert!(w.fake.calls().is_empty());
    }
    assert_eq!(seen[0], seen[1], "missing vs not opted in");
    assert_eq!(seen[0], seen[2], "missing vs no key");
}

#[tokio::test]
async fn oversized_user_data_is_refused_permanently_and_not_echoed() {
    let p = with_user_data(proxy());
    let mut s = user_data_secret();
    let mut big = LEAK_MARKER.as_bytes().to_vec();
    big.resize(MAX_USER_DATA + 1, b'x');
    s.data
        .as_mut()
        .unwrap()
        .insert(SECRET_KEY.into(), ByteString(big));
    let w = World::build(&p, &[s], None);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Permanent);
    assert_eq!(action, requeue(3600));
    assert!(w.fake.calls().is_empty());
    assert_eq!(w.timeline.last_status()["phase"], "Failed");
    assert_no_secret_in_requests(&w.timeline);
}

#[tokio::test]
async fn a_failing_secret_read_is_a_transient_kubernetes_error() {
    let p = with_user_data(proxy());
    let w = World::build(
        &p,
        &[user_data_secret()],
        Some(Box::new(|s: &Seen| {
            (s.method == "GET" && s.path.starts_with(SECRETS_PATH))
                .then(|| (503, status_error(503, "ServiceUnavailable", "try later")))
        })),
    );

    let (e, action) = w.reconcile_err(&p).await;

    assert!(matches!(e, ControllerError::Kube(_)), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(e.reason(), "KubernetesAPIError");
    assert_eq!(action, requeue(5));
    assert!(w.fake.calls().is_empty());
}

// ---- 8. Kubernetes API errors on the status write ----------------------------------------

/// A world whose status applies all fail with `code`.
fn failing_status(p: &Proxy, code: u16, reason: &'static str) -> World {
    World::build(
        p,
        &[],
        Some(Box::new(move |s: &Seen| {
            s.is_status_apply()
                .then(|| (code, status_error(code, reason, "status write refused")))
        })),
    )
}

#[tokio::test]
async fn kubernetes_api_errors_on_the_status_write_are_classified() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    for (code, reason, class, delay) in [
        (409, "Conflict", ErrorClass::Transient, 5),
        (500, "InternalError", ErrorClass::Transient, 5),
        (429, "TooManyRequests", ErrorClass::Transient, 5),
        (403, "Forbidden", ErrorClass::Permanent, 3600),
        (422, "Invalid", ErrorClass::Permanent, 3600),
    ] {
        // Written before probes: this status must be written again, and that fails.
        let p = with_status(proxy(), status_before_probes(&running));
        let w = failing_status(&p, code, reason);
        w.fake.insert(running.clone());

        let (e, action) = w.reconcile_err(&p).await;

        match &e {
            ControllerError::Kube(kube::Error::Api(s)) => assert_eq!(s.code, code),
            other => panic!("{code}: expected a Kubernetes API error, got {other:?}"),
        }
        assert_eq!(e.class(), class, "{code}");
        assert_eq!(
            kube_class(&kube::Error::Api(Box::new(
                kube::core::Status::failure("x", reason).with_code(code)
            ))),
            class,
            "{code}"
        );
        assert_eq!(action, requeue(delay), "{code}");
        assert_eq!(
            w.labels(),
            labels(&["provider:get", "status:Running"]),
            "{code}"
        );
        assert_eq!(w.ctx.metrics.reconciles(class.as_str()), 1, "{code}");
    }
}

#[tokio::test]
async fn a_refused_provisioning_status_stops_the_create_before_the_provider() {
    let p = proxy();
    let w = failing_status(&p, 409, "Conflict");

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(e.reason(), "KubernetesAPIError");
    assert_eq!(action, requeue(5));
    assert!(w.fake.calls().is_empty(), "{:?}", w.fake.calls());
    // It still tries to record the error, and says so in an event.
    assert_eq!(
        w.labels(),
        labels(&[
            "status:Provisioning",
            "status:Pending",
            "event:Warning:KubernetesAPIError",
        ])
    );
}

#[tokio::test]
async fn a_refused_final_status_write_fails_the_reconcile_and_the_retry_adopts() {
    let p = proxy();
    let mut refuse = 1;
    let w = World::build(
        &p,
        &[],
        Some(Box::new(move |s: &Seen| {
            if s.is_status_apply() && s.body["status"]["phase"] == "Running" && refuse > 0 {
                refuse -= 1;
                return Some((500, status_error(500, "InternalError", "etcd timeout")));
            }
            None
        })),
    );

    let (e, action) = w.reconcile_err(&p).await;
    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, requeue(5));
    assert_eq!(w.fake.instances().len(), 1);

    // The retry adopts the instance the first attempt made: still exactly one.
    w.timeline.clear();
    let p = with_status(
        p,
        status::provisioning(
            &ProxyStatus::default(),
            Some(GENERATION),
            "Creating",
            "creating the instance",
            long_ago(),
        ),
    );
    w.reconcile(&p).await.unwrap();
    assert_eq!(w.fake.instances().len(), 1);
    assert_eq!(w.timeline.last_status()["phase"], "Running");
}

// ---- 9. Backoff that our own status writes cannot defeat ----------------------------------

/// The Proxy as the watch delivers it after our last status write: the same metadata but
/// a new resourceVersion, and the status we wrote.
fn after_our_write(p: &Proxy, w: &World) -> Proxy {
    let mut next = with_status(
        p.clone(),
        serde_json::from_value(w.timeline.last_status()).unwrap(),
    );
    let rv: u64 = p
        .metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    next.metadata.resource_version = Some((rv + 1).to_string());
    next
}

#[tokio::test(start_paused = true)]
async fn our_own_status_write_does_not_rerun_a_failing_proxy_before_its_delay() {
    let p = proxy();
    let w = World::new(&p);
    w.fake.fail_always("create", Some(ErrorClass::Transient));

    let (_, action) = w.reconcile_err(&p).await;
    assert_eq!(action, requeue(5));

    // The status write comes back as a watch event: it only reschedules the Proxy.
    let echoed = after_our_write(&p, &w);
    w.timeline.clear();
    tokio::time::advance(Duration::from_secs(2)).await;
    let action = w.trigger(&echoed).await.unwrap();
    assert_eq!(action, requeue(3), "what is left of the 5 s");
    assert!(w.labels().is_empty(), "{:?}", w.labels());
    assert_eq!(w.fake.calls(), vec!["create"]);
    assert_eq!(w.ctx.metrics.deferred_triggers(), 1);
    assert_eq!(
        w.ctx.metrics.reconciles("transient"),
        1,
        "a deferral is no reconcile"
    );

    // An annotation someone set to ask for a reconcile runs it at once.
    let mut kicked = echoed.clone();
    kicked.metadata.annotations = Some([("kick".to_string(), "1".to_string())].into());
    let e = w.trigger(&kicked).await.expect_err("ran and failed");
    let action = error_policy(Arc::new(kicked), &e, w.ctx.clone());
    assert_eq!(w.fake.calls(), vec!["create", "create"]);
    assert_eq!(action, requeue(10), "the count went on: 5, then 10");
}

#[tokio::test]
async fn a_spec_change_or_a_deletion_runs_at_once_and_a_new_spec_starts_a_new_streak() {
    let p = proxy();
    let w = World::new(&p);
    w.fake.fail_always("create", Some(ErrorClass::Transient));
    for expected in [5, 10, 20] {
        let (_, action) = w.reconcile_err(&p).await;
        assert_eq!(action, requeue(expected));
    }

    // A new generation is not deferred, and its failures count from the start.
    let mut edited = after_our_write(&p, &w);
    edited.metadata.generation = Some(GENERATION + 1);
    let e = w.trigger(&edited).await.expect_err("ran and failed");
    let action = error_policy(Arc::new(edited.clone()), &e, w.ctx.clone());
    assert_eq!(action, requeue(5));
    assert_eq!(w.fake.calls().len(), 4);

    // Deletion is not deferred either: the finalizer's cleanup runs and lets it go.
    let gone = deleting(after_our_write(&edited, &w));
    w.timeline.clear();
    let action = w.trigger(&gone).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(w.timeline.finalizer_patches().len(), 1);
}

#[tokio::test]
async fn the_backoff_grows_with_failures_whatever_the_error_text_and_warns_once() {
    let p = proxy();
    let w = World::new(&p);
    // Every failure has a different message (the fake counts the calls).
    w.fake.fail_always("create", Some(ErrorClass::Transient));
    let mut p = p;
    let mut delays = Vec::new();
    let mut messages = Vec::new();
    for _ in 0..10 {
        let (_, action) = w.reconcile_err(&p).await;
        delays.push(action);
        messages.push(condition(&w.timeline.last_status(), "Ready")["message"].clone());
        p = after_our_write(&p, &w);
    }
    let expected: Vec<Action> = [5, 10, 20, 40, 80, 160, 320, 640, 900, 900]
        .into_iter()
        .map(requeue)
        .collect();
    assert_eq!(delays, expected);
    let distinct: std::collections::BTreeSet<String> =
        messages.iter().map(ToString::to_string).collect();
    assert_eq!(distinct.len(), 10, "the messages did change: {messages:?}");
    let warnings: Vec<_> = w
        .timeline
        .event_summary()
        .into_iter()
        .filter(|(t, _, _)| t == "Warning")
        .collect();
    assert_eq!(
        warnings.len(),
        1,
        "one warning per failure streak: {warnings:?}"
    );

    // A different reason is news; after a success the same reason is news again.
    w.fake.fail_always("create", Some(ErrorClass::Quota));
    w.reconcile_err(&p).await;
    w.fake.fail_always("create", None);
    w.reconcile(&p).await.unwrap();
    let reasons: Vec<String> = w
        .timeline
        .event_summary()
        .into_iter()
        .map(|e| e.1)
        .collect();
    assert_eq!(
        reasons,
        labels(&["ProviderError", "CapacityExceeded", "Created"])
    );
}

#[tokio::test]
async fn a_replacement_that_keeps_failing_forgets_the_old_instance_and_warns_once() {
    let crashed = instance(id("h2", &our_name()), UID, InstanceState::Crashed, None);
    let p = with_status(proxy(), status_seeing(&crashed));
    let w = World::new(&p);
    w.fake.insert(crashed);
    w.fake.fail_always("create", Some(ErrorClass::Transient));

    w.reconcile_err(&p).await;
    assert_eq!(w.fake.calls(), vec!["get", "delete", "create"]);
    let s = w.timeline.last_status();
    assert!(
        s.get("instanceId").is_none(),
        "the deleted instance is still named: {s:#}"
    );
    assert_eq!(condition(&s, "Provisioned")["status"], "False");

    // Each retry is one Create: no look-up of the deleted instance, no new warning.
    let mut p = after_our_write(&p, &w);
    for _ in 0..5 {
        w.reconcile_err(&p).await;
        p = after_our_write(&p, &w);
    }
    assert_eq!(w.fake.calls().len(), 3 + 5);
    assert!(w.fake.calls()[3..].iter().all(|c| *c == "create"));
    let reasons: Vec<String> = w
        .timeline
        .event_summary()
        .into_iter()
        .map(|e| e.1)
        .collect();
    assert_eq!(reasons, labels(&["InstanceFailed", "ProviderError"]));
}

// ---- 10. Leader fencing ------------------------------------------------------------------

/// Loses the lease as soon as a call of `op` returned, as a replica would whose lease ran
/// out while it worked.
struct LosesLeaseAfter {
    inner: Logged,
    op: &'static str,
    lease: tokio::sync::watch::Sender<bool>,
}

impl LosesLeaseAfter {
    fn after<T>(&self, op: &'static str, r: T) -> T {
        if op == self.op {
            self.lease.send_replace(false);
        }
        r
    }
}

impl Provider for LosesLeaseAfter {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move { self.after("create", self.inner.create(req).await) })
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move { self.after("get", self.inner.get(id).await) })
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move { self.after("delete", self.inner.delete(id).await) })
    }
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move { self.after("delete", self.inner.delete_owned(id, owner).await) })
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(async move { self.after("list", self.inner.list().await) })
    }
}

impl World {
    /// A world whose provider sits behind the fence, as in run mode, and whose lease is
    /// lost right after the first call of `op` (`None`: lost when the test says so).
    fn fenced(proxy: &Proxy, op: Option<&'static str>) -> (Self, tokio::sync::watch::Sender<bool>) {
        let (lease, rx) = tokio::sync::watch::channel(true);
        let fence = Fence::new(rx);
        let mut w = Self::new(proxy);
        let logged = Logged {
            inner: w.fake.clone(),
            timeline: w.timeline.clone(),
        };
        let inner = LosesLeaseAfter {
            inner: logged,
            op: op.unwrap_or("-"),
            lease: lease.clone(),
        };
        let mut registry = Registry::new();
        registry.insert(Arc::new(crate::provider::decorate::Fenced::new(
            Arc::new(inner),
            fence.clone(),
            Duration::from_secs(5),
        )));
        let mut ctx = Context::new(
            w.ctx.client.clone(),
            config(),
            Arc::new(registry),
            ControllerMetrics::default(),
            Some("egress-operator-0".into()),
        )
        .with_fence(fence);
        ctx.jitter = || 0.5;
        w.proxies.install(&mut ctx);
        w.ctx = Arc::new(ctx);
        (w, lease)
    }
}

#[tokio::test]
async fn a_replica_without_the_lease_starts_no_reconcile() {
    let p = proxy();
    let (w, lease) = World::fenced(&p, None);
    lease.send_replace(false);

    let (e, action) = w.reconcile_err(&p).await;

    assert!(e.is_lease_lost(), "{e}");
    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, Action::await_change());
    assert!(w.labels().is_empty(), "{:?}", w.labels());
    assert!(w.fake.calls().is_empty());
    assert_eq!(
        w.ctx.attempts.failures(UID, Some(GENERATION)),
        0,
        "not a failure"
    );
}

#[tokio::test(start_paused = true)]
async fn a_create_cut_short_by_the_lost_lease_defines_nothing_and_reports_nothing() {
    let p = proxy();
    let (w, lease) = World::fenced(&p, None);
    // The Create waits on a slow step (an image download); the lease goes meanwhile, and
    // the step ends within the grace: the Create's own check before define refuses.
    w.fake.set_create_delay(Duration::from_secs(2));
    let (r, ()) = tokio::join!(w.trigger(&p), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        lease.send_replace(false);
    });

    let e = r.expect_err("the Create was refused");
    assert!(e.is_lease_lost(), "{e}");
    assert!(
        matches!(
            e.to_string().as_str(),
            s if s.contains("did not start domain define")
        ),
        "{e}"
    );
    assert!(w.fake.instances().is_empty(), "nothing was defined");
    // Provisioning was written while leading; after the loss nothing was.
    assert_eq!(
        w.labels(),
        labels(&["status:Provisioning", "provider:create"])
    );
    assert!(w.timeline.events().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_create_in_flight_is_cancelled_a_grace_period_after_the_lease_is_lost() {
    let p = proxy();
    let (w, lease) = World::fenced(&p, None);
    // A step far longer than the 5 s grace.
    w.fake.set_create_delay(Duration::from_secs(600));
    let started = tokio::time::Instant::now();
    let (r, ()) = tokio::join!(w.trigger(&p), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        lease.send_replace(false);
    });

    let e = r.expect_err("cancelled");
    assert!(e.is_lease_lost(), "{e}");
    assert!(e.to_string().contains("cancelled"), "{e}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(6) && took < Duration::from_secs(7),
        "cancelled {took:?} after the start, not 1 s + the 5 s grace"
    );
    assert!(w.fake.instances().is_empty());
    // What it could not clean up is announced on the Proxy (issue 19, finding 6).
    let events = w.timeline.event_summary();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].0.as_str(), events[0].1.as_str()),
        ("Warning", "CreateCancelled")
    );
    assert!(events[0].2.contains("lost the leader lease"), "{events:?}");
}

#[tokio::test]
async fn a_deletion_cut_short_by_the_lost_lease_keeps_the_finalizer() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = deleting(with_status(proxy(), status_seeing(&running)));
    // The instance status names is deleted; the lease goes before the listing that looks
    // for instances status does not name.
    let (w, _lease) = World::fenced(&p, Some("delete"));
    w.fake.insert(running);

    let (e, action) = w.reconcile_err(&p).await;

    assert!(e.is_lease_lost(), "{e}");
    assert_eq!(action, Action::await_change());
    assert_eq!(
        w.labels(),
        labels(&["status:Deleting", "provider:delete"]),
        "no listing, no Deleted event, and the finalizer stays"
    );
    assert!(w.timeline.finalizer_patches().is_empty());
}

// ---- Graceful shutdown of the whole controller loop ----------------------------------------

/// A provider whose Create waits until the test lets it finish, so a shutdown can be
/// requested while a Create is in flight.
struct Gated {
    inner: Arc<FakeProvider>,
    entered: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Provider for Gated {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            self.entered.notify_one();
            let _permit = self.release.acquire().await;
            self.inner.create(req).await
        })
    }

    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.inner.get(id)
    }

    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.inner.delete(id)
    }

    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.inner.delete_owned(id, owner)
    }

    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        self.inner.list()
    }
}

/// SIGTERM in the middle of a Create: `run` stops taking work but returns only after the
/// Create finished and its status (naming the instance) was written, so no half-created
/// VM is left behind and the next leader adopts a recorded instance.
#[tokio::test]
async fn shutdown_waits_for_a_create_in_flight_and_its_status() {
    let proxy_value = serde_json::to_value(proxy()).unwrap();
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let timeline = Timeline::default();
    let server_timeline = timeline.clone();
    tokio::spawn(async move {
        // Watches are held open (never answered) for as long as the server runs.
        let mut watches = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let query = parts.uri.query().unwrap_or_default().to_string();
            let path = parts.uri.path().to_string();
            let seen = Seen {
                method: parts.method.to_string(),
                path: path.clone(),
                query: BTreeMap::new(),
                content_type: String::new(),
                body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            };
            let collection = "/apis/egress-operator.dev/v1alpha1/proxies";
            let (code, reply) = if path == collection && query.contains("watch=true") {
                watches.push(send);
                continue;
            } else if path == collection {
                (
                    200,
                    json!({"apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyList",
                           "metadata": {"resourceVersion": "41"}, "items": [proxy_value.clone()]}),
                )
            } else {
                server_timeline.push(Step::Api(seen.clone()));
                default_answer(&seen, &proxy_value, &BTreeMap::new())
            };
            let response = Response::builder()
                .status(code)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap();
            send.send_response(response);
        }
    });
    let client = Client::new(service, "default");

    let fake = Arc::new(FakeProvider::named("kvm2", &["h1", "h2"]));
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let mut providers = Registry::new();
    providers.insert(Arc::new(Gated {
        inner: fake.clone(),
        entered: entered.clone(),
        release: release.clone(),
    }));
    let mut ctx = Context::new(
        client,
        config(),
        Arc::new(providers),
        ControllerMetrics::default(),
        None,
    );
    Proxies::default().install(&mut ctx);
    let ctx = Arc::new(ctx);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let runner = tokio::spawn(run(ctx, 2, async move {
        let _ = stop_rx.await;
    }));

    guard(entered.notified()).await;
    stop_tx.send(()).unwrap();
    // Asked to stop, the loop still waits for the Create it is in.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !runner.is_finished(),
        "run returned with a Create in flight"
    );
    assert!(fake.instances().is_empty());

    release.add_permits(1);
    guard(runner).await.unwrap();
    assert_eq!(fake.instances().len(), 1, "the Create finished");
    let last = timeline.last_status();
    assert_eq!(last["phase"], "Running", "{last}");
    assert_eq!(
        last["instanceId"],
        json!(fake.instances()[0].id.to_string()),
        "the status names the instance before run returns"
    );
}

// ---- 11. Serving: Ready means it proxies ---------------------------------------------------

/// The Proxy as the API server holds it now: `p` with the status last written (if any).
fn as_stored(p: &Proxy, w: &World) -> Proxy {
    match w.timeline.statuses().pop() {
        Some(s) => with_status(p.clone(), serde_json::from_value(s).unwrap()),
        None => p.clone(),
    }
}

/// Lets `secs` of (paused) time pass, then reconciles the Proxy as stored.
async fn later(w: &World, p: &Proxy, secs: u64) -> Action {
    tokio::time::advance(Duration::from_secs(secs)).await;
    w.reconcile(&as_stored(p, w)).await.unwrap()
}

/// The delay of a requeue (whole seconds: the tests' jitter sits mid-band).
fn delay_of(a: &Action) -> u64 {
    (1..=3600)
        .find(|s| *a == requeue(*s))
        .unwrap_or_else(|| panic!("{a:?} is no whole-second requeue"))
}

fn warnings(w: &World) -> Vec<String> {
    w.timeline
        .event_summary()
        .into_iter()
        .filter(|(t, _, _)| t == "Warning")
        .map(|(_, r, _)| r)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn ready_waits_for_the_probe_and_serving_flips_with_its_own_time() {
    let p = proxy();
    let w = World::new(&p);
    // The new VM's proxy is not up yet.
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(action, requeue(5), "not serving: probed again soon");
    let s = w.timeline.last_status();
    assert_eq!(s["phase"], "Running", "phase is about the VM");
    assert_eq!(s["address"], FAKE_ADDRESS);
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(condition(&s, "Ready")["reason"], "NotServing");
    let serving = condition(&s, "Serving").clone();
    assert_eq!(serving["status"], "False");
    assert_eq!(serving["reason"], "ConnectionRefused");
    assert_eq!(
        serving["message"],
        format!("{FAKE_ADDRESS}:3128 refused the connection: nothing listens on the proxy port")
    );
    assert_eq!(
        w.timeline.event_summary(),
        vec![(
            "Normal".into(),
            "Created".into(),
            format!("created instance h1/{}", our_name())
        )],
        "no Ready event, and no warning for a proxy that never served yet"
    );

    // Still refused: backs off, writes nothing (nothing changed), announces nothing.
    w.timeline.clear();
    let stored = with_status(p.clone(), serde_json::from_value(s.clone()).unwrap());
    tokio::time::advance(Duration::from_secs(5)).await;
    let action = w.reconcile(&stored).await.unwrap();
    assert_eq!(action, requeue(10));
    assert_eq!(w.labels(), labels(&["provider:get"]));

    // It answers: Ready, one Ready event, the probe period; Serving's time moved.
    w.timeline.clear();
    tokio::time::advance(Duration::from_secs(10)).await;
    w.proxies.set(FAKE_ADDRESS, Answer::Serve);
    let action = w.reconcile(&stored).await.unwrap();
    assert_eq!(action, requeue(30));
    assert_eq!(
        w.labels(),
        labels(&["provider:get", "status:Running", "event:Normal:Ready"])
    );
    let s2 = w.timeline.last_status();
    assert_eq!(condition(&s2, "Ready")["status"], "True");
    assert_eq!(condition(&s2, "Serving")["status"], "True");
    assert_ne!(
        condition(&s2, "Serving")["lastTransitionTime"],
        serving["lastTransitionTime"]
    );
    assert_eq!(
        condition(&s2, "Provisioned")["lastTransitionTime"],
        condition(&s, "Provisioned")["lastTransitionTime"]
    );
    assert_eq!(w.ctx.metrics.probes.outcomes("ConnectionRefused"), 2);
    assert_eq!(w.ctx.metrics.probes.outcomes("Serving"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_proxy_that_hangs_times_out_within_the_probe_budget() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running);
    w.proxies.set(FAKE_ADDRESS, Answer::Hang);
    let started = tokio::time::Instant::now();

    let action = w.reconcile(&p).await.unwrap();

    assert_eq!(
        started.elapsed(),
        Duration::from_secs(u64::from(w.ctx.config.serving.timeout_seconds))
    );
    assert_eq!(action, requeue(5));
    let s = w.timeline.last_status();
    assert_eq!(condition(&s, "Serving")["reason"], "Timeout");
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(warnings(&w), ["NotServing"], "it served before: news once");
}

#[tokio::test]
async fn a_guest_whose_proxy_fails_and_whose_host_name_is_not_the_seeds_says_so() {
    let mut unseeded = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    unseeded.seed_applied = Some(false);
    let p = with_status(proxy(), status_before_probes(&unseeded));
    let w = World::new(&p);
    w.fake.insert(unseeded);
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);

    w.reconcile(&p).await.unwrap();

    assert_eq!(
        w.proxies.dials(),
        1,
        "the probe decides, the host name only hints"
    );
    let s = w.timeline.last_status();
    let serving = condition(&s, "Serving");
    assert_eq!(serving["status"], "False");
    assert_eq!(serving["reason"], "SeedNotRead");
    let message = serving["message"].as_str().unwrap();
    assert!(
        message.contains("refused the connection")
            && message.contains("may never have read its cloud-init seed"),
        "{serving:#}"
    );
    assert_eq!(condition(&s, "Ready")["reason"], "SeedNotRead");
    assert_eq!(warnings(&w), ["SeedNotRead"]);

    // Again: nothing new to say or write.
    let stored = as_stored(&p, &w);
    w.timeline.clear();
    w.reconcile(&stored).await.unwrap();
    assert!(w.timeline.events().is_empty(), "{:?}", w.labels());
    assert!(w.timeline.statuses().is_empty(), "{:?}", w.labels());
}

/// Issue 19, finding 1: user-data's `hostname` wins over the seed's `local-hostname`, so
/// a guest that read its seed and serves reports another host name. It is Ready, and it
/// is not replaced when the grace runs out.
#[tokio::test(start_paused = true)]
async fn a_guest_renamed_by_its_user_data_serves_is_ready_and_is_never_replaced() {
    let mut renamed = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    renamed.seed_applied = Some(false);
    let p = with_status(proxy(), status_before_probes(&renamed));
    let w = World::new(&p);
    w.fake.insert(renamed);

    w.reconcile(&p).await.unwrap();
    let s = w.timeline.last_status();
    assert_eq!(condition(&s, "Serving")["status"], "True", "{s:#}");
    assert_eq!(condition(&s, "Ready")["status"], "True", "{s:#}");
    assert!(warnings(&w).is_empty(), "{:?}", w.labels());

    let grace = u64::from(w.ctx.config.serving.replace_after_seconds);
    for _ in 0..2 * grace / 30 {
        assert_eq!(later(&w, &p, 30).await, requeue(30));
    }
    assert!(
        w.fake.calls().iter().all(|c| *c == "get"),
        "{:?}",
        w.fake.calls()
    );
    assert!(is_ready_value(&as_stored(&p, &w)));
}

#[tokio::test(start_paused = true)]
async fn a_flapping_proxy_is_never_replaced_and_one_that_stays_down_is_replaced_once() {
    let grace: u64 = 900;
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    assert_eq!(u64::from(w.ctx.config.serving.replace_after_seconds), grace);
    w.fake.insert(running);
    assert_eq!(later(&w, &p, 0).await, requeue(30));

    // Down for most of the grace, retried on a doubling delay up to the period.
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    let (mut next, mut down, mut delays) = (30, 0, Vec::new());
    while down + next < grace - 60 {
        down += next;
        next = delay_of(&later(&w, &p, next).await);
        delays.push(next);
    }
    assert_eq!(&delays[..5], [5, 10, 20, 30, 30]);
    // Back before the grace ran out: nothing was replaced.
    w.proxies.set(FAKE_ADDRESS, Answer::Serve);
    assert_eq!(later(&w, &p, next).await, requeue(30));
    assert!(
        !w.fake
            .calls()
            .iter()
            .any(|c| *c == "delete" || *c == "create"),
        "{:?}",
        w.fake.calls()
    );
    assert!(is_ready_value(&as_stored(&p, &w)));

    // Down again: the grace starts over at this flip, and runs out once.
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    let mut down = 0;
    let mut next = 30;
    let mut replaced_after = None;
    // Until just before the new instance's own grace could run out.
    while down < 2 * grace - 60 {
        down += next;
        next = delay_of(&later(&w, &p, next).await);
        if replaced_after.is_none() && w.fake.calls().contains(&"create") {
            replaced_after = Some(down);
        }
    }
    let replaced_after = replaced_after.expect("never replaced");
    // The first failed probe came 30 s after the flip's last pass; the grace counts from
    // that failure (the condition's transition), and the retries are at most 30 s apart.
    assert!(
        (grace..grace + 30 + 30).contains(&replaced_after),
        "replaced {replaced_after} s after the proxy went down"
    );
    let calls = w.fake.calls();
    assert_eq!(
        calls.iter().filter(|c| **c == "delete").count(),
        1,
        "{calls:?}"
    );
    assert_eq!(
        calls.iter().filter(|c| **c == "create").count(),
        1,
        "{calls:?}"
    );
    assert_eq!(w.ctx.metrics.instances("replaced-not-serving"), 1);
    let reasons: Vec<(String, String)> = w
        .timeline
        .event_summary()
        .into_iter()
        .map(|(t, r, _)| (t, r))
        .collect();
    let count = |r: &str| reasons.iter().filter(|(_, x)| x == r).count();
    assert_eq!(count("NotServing"), 2, "one per flip: {reasons:?}");
    assert_eq!(count("InstanceNotServing"), 1, "{reasons:?}");
    assert_eq!(count("Replaced"), 1, "{reasons:?}");
    let why = w
        .timeline
        .event_summary()
        .into_iter()
        .find(|(_, r, _)| r == "InstanceNotServing")
        .unwrap()
        .2;
    assert!(
        why.contains("has not served since") && why.contains("refused the connection"),
        "{why}"
    );
}

#[tokio::test(start_paused = true)]
async fn replacement_counts_from_status_so_a_restart_does_not_shorten_or_reset_the_grace() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running.clone());
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    later(&w, &p, 0).await;
    let down = as_stored(&p, &w);

    // A new replica (nothing in memory) 800 s later: not yet.
    let w2 = World::new(&down);
    w2.fake.insert(running.clone());
    w2.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    tokio::time::advance(Duration::from_secs(800)).await;
    w2.reconcile(&down).await.unwrap();
    assert_eq!(w2.fake.calls(), vec!["get"]);
    // ... at 900 s from the flip (the clock of the first replica; both follow paused
    // time from nearly the same real instant): replaced.
    tokio::time::advance(Duration::from_secs(101)).await;
    w2.reconcile(&down).await.unwrap();
    assert_eq!(w2.fake.calls(), vec!["get", "get", "delete", "create"]);
}

#[tokio::test(start_paused = true)]
async fn a_zero_grace_never_replaces() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    let config = crate::config::parse(
        &format!("{CONFIG}serving: {{replaceAfterSeconds: 0}}\n"),
        "controller-test.yaml",
        Path::new("/"),
    )
    .unwrap();
    assert_eq!(config.serving.replace_after_seconds, 0);
    let mut ctx = Context::new(
        w.ctx.client.clone(),
        Arc::new(config),
        w.ctx.providers.clone(),
        ControllerMetrics::default(),
        None,
    );
    w.proxies.install(&mut ctx);
    let w = World {
        ctx: Arc::new(ctx),
        ..w
    };
    w.fake.insert(running);
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);

    for _ in 0..100 {
        later(&w, &p, 60).await;
    }

    assert!(
        w.fake.calls().iter().all(|c| *c == "get"),
        "{:?}",
        w.fake.calls()
    );
    assert!(!is_ready_value(&as_stored(&p, &w)));
}

/// Issue 19, finding 3: the operator's own path to a host's bridge is cut, so every
/// proxy there times out. The prober is suspected: nothing is replaced, and the
/// condition, an event and a metric say so. Issue 33, item 2: for at most
/// `GUARD_MAX_HOLD` from the first withheld replacement; after that the probe is believed
/// (a whole host can die) and the overdue proxy is replaced.
#[tokio::test(start_paused = true)]
async fn a_host_whose_proxies_all_time_out_at_once_suspects_the_prober_and_replaces_nothing() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running);
    w.proxies.set(FAKE_ADDRESS, Answer::Hang);
    let grace = u64::from(w.ctx.config.serving.replace_after_seconds);
    let timed_out = serving::Check {
        serving: false,
        reason: "Timeout",
        message: "no answer".into(),
        running: true,
    };
    // Two other proxies of h1, checked by their own reconciles as often as ours: until
    // the replacement falls due and is withheld, then for nearly the whole bound.
    let bound = guard_bound_secs();
    let mut down = 0;
    let mut withheld_at = None;
    while withheld_at.is_none_or(|at| down < at + bound - 30) {
        assert!(down <= 2 * grace, "no replacement fell due in {down} s");
        for other in ["other-1", "other-2"] {
            w.ctx.serving.checked(other, "h1", &timed_out);
        }
        later(&w, &p, 30).await;
        down += 30;
        if withheld_at.is_none() && w.ctx.metrics.instances("replacement-withheld") > 0 {
            withheld_at = Some(down);
        }
    }
    assert!(
        w.fake.calls().iter().all(|c| *c == "get"),
        "{:?}",
        w.fake.calls()
    );
    let s = w.timeline.last_status();
    let serving = condition(&s, "Serving");
    assert_eq!(serving["reason"], "ProberSuspected", "{serving:#}");
    assert!(
        serving["message"]
            .as_str()
            .unwrap()
            .contains("3 of the 3 proxies probed on host h1"),
        "{serving:#}"
    );
    assert_eq!(
        warnings(&w)
            .iter()
            .filter(|r| *r == "ProberSuspected")
            .count(),
        1,
        "news once: {:?}",
        warnings(&w)
    );
    assert!(w.ctx.metrics.instances("replacement-withheld") > 0);
    assert_eq!(w.ctx.metrics.instances("replaced-not-serving"), 0);

    // The others still time out, but the hold has lasted its bound: the probe is
    // believed, and ours is replaced.
    for other in ["other-1", "other-2"] {
        w.ctx.serving.checked(other, "h1", &timed_out);
    }
    later(&w, &p, 60).await;
    assert_eq!(w.ctx.metrics.instances("replaced-not-serving"), 1);
}

/// `GUARD_MAX_HOLD` in whole seconds.
fn guard_bound_secs() -> u64 {
    crate::serving::GUARD_MAX_HOLD.as_secs()
}

/// When the others answer again, the one that still times out is replaced at once (the
/// prober is no longer suspected).
#[tokio::test(start_paused = true)]
async fn a_proxy_that_alone_times_out_on_its_host_is_replaced() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running);
    w.proxies.set(FAKE_ADDRESS, Answer::Hang);
    let grace = u64::from(w.ctx.config.serving.replace_after_seconds);
    let pass = serving::Check {
        serving: true,
        reason: "Serving",
        message: "answered".into(),
        running: true,
    };
    let mut down = 0;
    while w.ctx.metrics.instances("replaced-not-serving") == 0 {
        assert!(down <= 2 * grace, "not replaced after {down} s");
        for other in ["other-1", "other-2"] {
            w.ctx.serving.checked(other, "h1", &pass);
        }
        later(&w, &p, 30).await;
        down += 30;
    }
    assert_eq!(w.ctx.metrics.instances("replacement-withheld"), 0);
}

/// Issue 19, finding 3: a VM paused for an hour is not replaced at its first failed
/// probe after the resume; its grace counts from when it could serve again.
#[tokio::test(start_paused = true)]
async fn a_resumed_instance_gets_its_whole_grace() {
    let running = instance(
        id("h1", &our_name()),
        UID,
        InstanceState::Running,
        Some(FAKE_ADDRESS),
    );
    let p = with_status(proxy(), status_seeing(&running));
    let w = World::new(&p);
    w.fake.insert(running.clone());
    w.proxies.set(FAKE_ADDRESS, Answer::Refuse);
    let grace = u64::from(w.ctx.config.serving.replace_after_seconds);
    later(&w, &p, 0).await;
    later(&w, &p, 60).await;
    // Paused for an hour.
    w.fake.set_state(&running.id, InstanceState::Paused);
    for _ in 0..60 {
        later(&w, &p, 60).await;
    }
    // Resumed, the proxy not up yet: not replaced for the whole grace.
    w.fake.set_state(&running.id, InstanceState::Running);
    let mut up = 0;
    while up + 30 < grace {
        later(&w, &p, 30).await;
        up += 30;
        assert_eq!(
            w.ctx.metrics.instances("replaced-not-serving"),
            0,
            "replaced {up} s after the resume"
        );
    }
    // ... and replaced once it ran out.
    for _ in 0..4 {
        later(&w, &p, 30).await;
    }
    assert_eq!(w.ctx.metrics.instances("replaced-not-serving"), 1);
}

fn is_ready_value(p: &Proxy) -> bool {
    status::is_ready(p.status.as_ref().unwrap())
}

mod churn;
mod drift;
mod server_rules;

#[test]
fn the_proxy_cache_keeps_no_managed_fields_and_everything_else() {
    let mut proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {
            "name": "p", "namespace": "ns", "uid": "u", "generation": 2,
            "finalizers": ["egress-operator.dev/instance"],
            "managedFields": [{"manager": "egress-operator", "operation": "Apply",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {"provider": "kvm2"},
        "status": {"address": "10.0.0.1"},
    }))
    .unwrap();
    let before = serde_json::to_value(&proxy).unwrap();
    strip_for_cache(&mut proxy);
    assert_eq!(proxy.metadata.managed_fields, None);
    let mut after = serde_json::to_value(&proxy).unwrap();
    after["metadata"]["managedFields"] = before["metadata"]["managedFields"].clone();
    assert_eq!(after, before, "only managedFields go");
}
