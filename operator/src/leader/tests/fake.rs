//! An in-memory Lease API for the elector's tests, and a check of the fake itself.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode, Uri};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::client::Body;
use serde_json::{Map, Value, json};

/// The part of the Kubernetes API that a Lease elector may use, on
/// `coordination.k8s.io/v1` Leases, shared by every client made with [`client`]:
///
/// - GET one lease; 404 `NotFound` if missing.
/// - POST a lease; 409 `AlreadyExists` if present. The crate creates an empty lease.
/// - PATCH `application/apply-patch+yaml` (server-side apply): needs `fieldManager`,
///   honours `force`, creates a missing lease. Without `force`, setting a field to a
///   different value than it has while another manager owns it is a 409 `Conflict`:
///   this is what keeps two replicas from taking a free lease at once. Fields the manager
///   applied before and now leaves out are given up (removed if nobody else owns them).
/// - PATCH strategic-merge or merge patch (what `kube-lease-manager` used to renew and
///   release): sets fields, `null` deletes; never conflicts; takes ownership of changed
///   fields from everyone else. Counted as an unguarded write.
/// - PUT (update): replaces the spec; with `metadata.resourceVersion` it is refused with
///   409 `Conflict` unless that is the stored version; without it, it is accepted and
///   counted as an unguarded write.
///
/// Ownership is tracked per top-level `spec` field and per manager and operation, as
/// `managedFields` would. Not implemented (not used): metadata beyond name, namespace
/// and resourceVersion; list, watch, delete; JSON patch. Any other
/// request is recorded in `unexpected` and refused, so a test notices.
#[derive(Default)]
pub(super) struct FakeApi {
    pub(super) state: Mutex<FakeState>,
}

#[derive(Default)]
pub(super) struct FakeState {
    pub(super) leases: BTreeMap<(String, String), StoredLease>,
    /// Every change of `holderIdentity`, in order.
    pub(super) changes: Vec<HolderChange>,
    /// Patches that moved `renewTime` while the holder stayed the same.
    pub(super) renewals: usize,
    pub(super) unexpected: Vec<String>,
    /// Answer everything with 503, as an unreachable API server would.
    pub(super) failing: bool,
    /// Answer the next requests with these codes, one each, then serve again: a burst of
    /// transient failures.
    pub(super) fail_next: std::collections::VecDeque<StatusCode>,
    /// Before each of this many next updates, someone else touches the lease (a new
    /// resourceVersion, the record unchanged), as `kubectl annotate` between the
    /// elector's read and its write would.
    pub(super) touch_before_updates: usize,
    /// Never answer writes that name this holder (a renewal stuck in a slow API server).
    pub(super) stalled_holder: Option<String>,
    /// Writes that no resourceVersion guarded (patches, updates without a version).
    pub(super) unguarded: Vec<String>,
    pub(super) resource_version: u64,
}

#[derive(Default)]
pub(super) struct StoredLease {
    pub(super) spec: Map<String, Value>,
    /// Field name to the `manager/Operation` keys that own it.
    pub(super) owners: BTreeMap<String, BTreeSet<String>>,
    pub(super) resource_version: u64,
}

#[derive(Debug, Clone)]
pub(super) struct HolderChange {
    pub(super) at: Timestamp,
    /// Field manager of the request that made the change.
    pub(super) by: String,
    pub(super) before: Option<String>,
    pub(super) after: Option<String>,
    /// When the lease held before the change expired (renewTime + duration).
    pub(super) expiry_before: Option<Timestamp>,
}

impl StoredLease {
    pub(super) fn holder(&self) -> Option<String> {
        self.spec
            .get("holderIdentity")
            .and_then(Value::as_str)
            .map(str::to_string)
    }

    pub(super) fn expiry(&self) -> Option<Timestamp> {
        let renew: Timestamp = self.spec.get("renewTime")?.as_str()?.parse().ok()?;
        let secs = self.spec.get("leaseDurationSeconds")?.as_i64()?;
        renew.checked_add(SignedDuration::from_secs(secs)).ok()
    }

    pub(super) fn remove(&mut self, field: &str) {
        self.spec.remove(field);
        self.owners.remove(field);
    }

    pub(super) fn to_json(&self, namespace: &str, name: &str) -> Value {
        json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "resourceVersion": self.resource_version.to_string(),
            },
            "spec": Value::Object(self.spec.clone()),
        })
    }

    /// Server-side apply; `Err` lists the conflicting fields.
    pub(super) fn apply(
        &mut self,
        manager: &str,
        force: bool,
        config: &Map<String, Value>,
    ) -> Result<(), Vec<String>> {
        let me = format!("{manager}/Apply");
        if !force {
            let conflicts: Vec<String> = config
                .iter()
                .filter(|(field, value)| {
                    self.spec
                        .get(*field)
                        .is_some_and(|current| current != *value)
                        && self
                            .owners
                            .get(*field)
                            .is_some_and(|owners| owners.iter().any(|o| *o != me))
                })
                .map(|(field, _)| field.clone())
                .collect();
            if !conflicts.is_empty() {
                return Err(conflicts);
            }
        }
        let given_up: Vec<String> = self
            .owners
            .iter()
            .filter(|(field, owners)| owners.contains(&me) && !config.contains_key(*field))
            .map(|(field, _)| field.clone())
            .collect();
        for field in given_up {
            if let Some(owners) = self.owners.get_mut(&field) {
                owners.remove(&me);
                if owners.is_empty() {
                    self.remove(&field);
                }
            }
        }
        for (field, value) in config {
            if value.is_null() {
                self.remove(field);
                continue;
            }
            let changed = self.spec.get(field) != Some(value);
            self.spec.insert(field.clone(), value.clone());
            let owners = self.owners.entry(field.clone()).or_default();
            if changed {
                owners.clear();
            }
            owners.insert(me.clone());
        }
        Ok(())
    }

    /// Strategic-merge or merge patch of scalar fields.
    pub(super) fn update(&mut self, manager: &str, patch: &Map<String, Value>) {
        let me = format!("{manager}/Update");
        for (field, value) in patch {
            if value.is_null() {
                self.remove(field);
            } else if self.spec.get(field) != Some(value) {
                self.spec.insert(field.clone(), value.clone());
                self.owners
                    .insert(field.clone(), BTreeSet::from([me.clone()]));
            }
        }
    }
}

pub(super) fn respond(code: StatusCode, body: &Value) -> Response<Body> {
    let mut response = Response::new(Body::from(body.to_string().into_bytes()));
    *response.status_mut() = code;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

pub(super) fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    respond(
        code,
        &json!({
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code.as_u16(),
        }),
    )
}

impl FakeApi {
    pub(super) async fn serve(&self, request: Request<Body>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let body = match body.collect_bytes().await {
            Ok(body) => body,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        };
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let stalled = self.state.lock().unwrap().stalled_holder.clone();
        if let Some(holder) = stalled
            && parts.method == Method::PUT
            && String::from_utf8_lossy(&body).contains(&format!("\"holderIdentity\":\"{holder}\""))
        {
            return std::future::pending().await;
        }
        self.state
            .lock()
            .unwrap()
            .handle(&parts.method, &parts.uri, content_type, &body)
    }

    pub(super) fn stall_writes_of(&self, holder: &str) {
        self.state.lock().unwrap().stalled_holder = Some(holder.to_string());
    }

    pub(super) fn holder(&self) -> Option<String> {
        let state = self.state.lock().unwrap();
        state.leases.values().next().and_then(StoredLease::holder)
    }

    pub(super) fn changes(&self) -> Vec<HolderChange> {
        self.state.lock().unwrap().changes.clone()
    }

    pub(super) fn renewals(&self) -> usize {
        self.state.lock().unwrap().renewals
    }

    pub(super) fn unexpected(&self) -> Vec<String> {
        self.state.lock().unwrap().unexpected.clone()
    }

    pub(super) fn set_failing(&self, failing: bool) {
        self.state.lock().unwrap().failing = failing;
    }

    /// Answers the next requests with `codes`, one each.
    pub(super) fn fail_next(&self, codes: &[StatusCode]) {
        self.state
            .lock()
            .unwrap()
            .fail_next
            .extend(codes.iter().copied());
    }

    /// Failures queued by [`FakeApi::fail_next`] not answered yet.
    pub(super) fn failures_left(&self) -> usize {
        self.state.lock().unwrap().fail_next.len()
    }

    /// Someone touches the lease before each of the next `n` updates.
    pub(super) fn touch_before_updates(&self, n: usize) {
        self.state.lock().unwrap().touch_before_updates = n;
    }

    /// Touches left of [`FakeApi::touch_before_updates`].
    pub(super) fn touches_left(&self) -> usize {
        self.state.lock().unwrap().touch_before_updates
    }

    /// Someone touches the lease now (a new resourceVersion, the record unchanged).
    pub(super) fn touch(&self) {
        self.state.lock().unwrap().touch();
    }

    pub(super) fn unguarded(&self) -> Vec<String> {
        self.state.lock().unwrap().unguarded.clone()
    }
}

impl FakeState {
    pub(super) fn handle(
        &mut self,
        method: &Method,
        uri: &Uri,
        content_type: &str,
        body: &[u8],
    ) -> Response<Body> {
        if self.failing {
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "injected failure",
            );
        }
        if let Some(code) = self.fail_next.pop_front() {
            return status(code, "InjectedFailure", "injected failure");
        }
        let query: BTreeMap<String, String> =
            url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
                .into_owned()
                .collect();
        let segments: Vec<&str> = uri
            .path()
            .strip_prefix("/apis/coordination.k8s.io/v1/namespaces/")
            .map(|rest| rest.split('/').collect())
            .unwrap_or_default();
        match (method, segments.as_slice()) {
            (&Method::GET, [ns, "leases", name]) => match self.leases.get(&key(ns, name)) {
                Some(lease) => respond(StatusCode::OK, &lease.to_json(ns, name)),
                None => not_found(name),
            },
            (&Method::POST, [ns, "leases"]) => self.create(ns, body),
            (&Method::PATCH, [ns, "leases", name]) => {
                self.unguarded.push(format!("PATCH {content_type}"));
                self.patch(ns, name, content_type, &query, body)
            }
            (&Method::PUT, [ns, "leases", name]) => {
                if self.touch_before_updates > 0 {
                    self.touch_before_updates -= 1;
                    self.touch();
                }
                self.replace(ns, name, &query, body)
            }
            _ => {
                self.unexpected.push(format!("{method} {uri}"));
                status(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "MethodNotAllowed",
                    "not implemented by the fake",
                )
            }
        }
    }

    /// A write that changes no field of the record: a new resourceVersion only (what
    /// an annotation or a label does to the fake, which keeps no metadata).
    pub(super) fn touch(&mut self) {
        self.resource_version += 1;
        let version = self.resource_version;
        for lease in self.leases.values_mut() {
            lease.resource_version = version;
        }
    }

    pub(super) fn create(&mut self, ns: &str, body: &[u8]) -> Response<Body> {
        let lease: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        };
        let Some(name) = lease.pointer("/metadata/name").and_then(Value::as_str) else {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name is required",
            );
        };
        if self.leases.contains_key(&key(ns, name)) {
            return status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("leases \"{name}\" already exists"),
            );
        }
        let mut spec = lease
            .get("spec")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        spec.retain(|_, v| !v.is_null());
        self.resource_version += 1;
        let stored = StoredLease {
            spec,
            owners: BTreeMap::new(),
            resource_version: self.resource_version,
        };
        let json = stored.to_json(ns, name);
        self.leases.insert(key(ns, name), stored);
        respond(StatusCode::CREATED, &json)
    }

    pub(super) fn replace(
        &mut self,
        ns: &str,
        name: &str,
        query: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Response<Body> {
        let lease: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        };
        let manager = query.get("fieldManager").cloned().unwrap_or_default();
        let Some(stored) = self.leases.get(&key(ns, name)) else {
            return not_found(name);
        };
        match lease
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
        {
            None => self.unguarded.push(format!("PUT by {manager}")),
            Some(v) if v != stored.resource_version.to_string() => {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!(
                        "Operation cannot be fulfilled on leases.coordination.k8s.io \
                         \"{name}\": the object has been modified"
                    ),
                );
            }
            Some(_) => {}
        }
        let (before, expiry_before, renew_before) = (
            stored.holder(),
            stored.expiry(),
            stored.spec.get("renewTime").cloned(),
        );
        let mut spec = lease
            .get("spec")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        spec.retain(|_, v| !v.is_null());
        self.resource_version += 1;
        let resource_version = self.resource_version;
        let Some(stored) = self.leases.get_mut(&key(ns, name)) else {
            return not_found(name);
        };
        stored.spec = spec;
        stored.owners.clear();
        stored.resource_version = resource_version;
        let after = stored.holder();
        let renew_after = stored.spec.get("renewTime").cloned();
        let json = stored.to_json(ns, name);
        if before != after {
            self.changes.push(HolderChange {
                at: Timestamp::now(),
                by: manager,
                before,
                after,
                expiry_before,
            });
        } else if before.is_some() && renew_before != renew_after {
            self.renewals += 1;
        }
        respond(StatusCode::OK, &json)
    }

    pub(super) fn patch(
        &mut self,
        ns: &str,
        name: &str,
        content_type: &str,
        query: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Response<Body> {
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        };
        let spec = patch
            .get("spec")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let manager = query.get("fieldManager").cloned();
        let (before, expiry_before, renew_before) = self
            .leases
            .get(&key(ns, name))
            .map(|l| (l.holder(), l.expiry(), l.spec.get("renewTime").cloned()))
            .unwrap_or_default();
        match content_type {
            "application/apply-patch+yaml" => {
                let Some(manager) = manager.as_deref() else {
                    return status(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        "fieldManager is required for apply",
                    );
                };
                let force = query.get("force").is_some_and(|f| f == "true");
                let lease = self.leases.entry(key(ns, name)).or_default();
                if let Err(fields) = lease.apply(manager, force, &spec) {
                    return status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        &format!("Apply failed with conflicts on spec fields {fields:?}"),
                    );
                }
            }
            "application/strategic-merge-patch+json" | "application/merge-patch+json" => {
                let Some(lease) = self.leases.get_mut(&key(ns, name)) else {
                    return not_found(name);
                };
                lease.update(manager.as_deref().unwrap_or("unknown"), &spec);
            }
            other => {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    &format!("{other} is not implemented by the fake"),
                );
            }
        }
        self.resource_version += 1;
        let resource_version = self.resource_version;
        let Some(lease) = self.leases.get_mut(&key(ns, name)) else {
            return not_found(name);
        };
        lease.resource_version = resource_version;
        let after = lease.holder();
        let renew_after = lease.spec.get("renewTime").cloned();
        let json = lease.to_json(ns, name);
        if before != after {
            self.changes.push(HolderChange {
                at: Timestamp::now(),
                by: manager.unwrap_or_default(),
                before,
                after,
                expiry_before,
            });
        } else if before.is_some() && renew_before != renew_after {
            self.renewals += 1;
        }
        respond(StatusCode::OK, &json)
    }
}

pub(super) fn key(ns: &str, name: &str) -> (String, String) {
    (ns.to_string(), name.to_string())
}

pub(super) fn not_found(name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("leases \"{name}\" not found"),
    )
}

/// A client of `fake`; each has its own connection (mock) but they share the state.
pub(super) fn client(fake: &Arc<FakeApi>) -> Client {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let fake = Arc::clone(fake);
    tokio::spawn(async move {
        while let Some((request, reply)) = handle.next_request().await {
            reply.send_response(fake.serve(request).await);
        }
    });
    Client::new(mock, "default")
}

/// The handover tests rely on the fake refusing a second replica's apply; check it does.
#[tokio::test]
async fn fake_refuses_an_apply_over_another_managers_field() {
    let fake = Arc::new(FakeApi::default());
    let api: Api<Lease> = Api::namespaced(client(&fake), "ns");
    let holder = |h: &str| {
        Patch::Apply(json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "spec": { "holderIdentity": h },
        }))
    };
    let err = api.get("l").await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 404),
        "{err}"
    );

    api.patch("l", &PatchParams::apply("m1"), &holder("one"))
        .await
        .unwrap();
    // Its own field: no conflict. The same value from another manager: shared.
    api.patch("l", &PatchParams::apply("m1"), &holder("two"))
        .await
        .unwrap();
    api.patch("l", &PatchParams::apply("m2"), &holder("two"))
        .await
        .unwrap();
    let err = api
        .patch("l", &PatchParams::apply("m3"), &holder("three"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict"),
        "{err}"
    );
    api.patch("l", &PatchParams::apply("m3").force(), &holder("three"))
        .await
        .unwrap();
    // An update never conflicts, and a null deletes.
    let clear = Patch::Strategic(json!({ "spec": { "holderIdentity": null } }));
    api.patch("l", &PatchParams::default(), &clear)
        .await
        .unwrap();
    let lease = api.get("l").await.unwrap();
    assert_eq!(lease.spec.unwrap_or_default().holder_identity, None);
    api.patch("l", &PatchParams::apply("m1"), &holder("four"))
        .await
        .unwrap();
    assert_eq!(fake.holder().as_deref(), Some("four"));
}
