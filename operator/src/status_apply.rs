//! Status writes by server-side apply: strict first, and when the installed CRD lags the
//! binary, the same write without the fields the CRD does not know (issue 33, item 12).
//!
//! Server-side apply is strict whatever `fieldValidation` says: a field the installed
//! schema lacks is refused with an error that names it ("field not declared in schema";
//! the API server answers 500 for it today, kubernetes#139253), instead of being pruned in
//! silence. But when the CRDs are older than the operator (a binary rolled out before
//! `config/crd`), every status write then failed, and the objects kept a stale status
//! with no event: a pool's counts, a Proxy's address. Now such a write is made again as a
//! merge patch with field validation off, so the API server drops the unknown fields, and
//! the caller says so (a Warning event naming the fields, a warn log and
//! `egress_status_fields_dropped_total`): the status stays current and the skew is
//! visible until the CRDs are upgraded. A merge patch cannot remove a field by leaving it
//! out, so a status field the operator stops writing may linger while it falls back.

use std::fmt::Debug;

use kube::Api;
use kube::api::{Patch, PatchParams};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;

/// How a status apply went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Written whole.
    Whole,
    /// Written without the fields the installed CRD does not know; the API server's
    /// words for them.
    Dropped(String),
    /// Not sent: the same body went through the fallback last time, and the object's
    /// status is still what that write left (see [`FallbackMemory`]).
    AsBefore,
}

/// Most objects [`FallbackMemory`] remembers; past that it starts again (a write more
/// per object, once).
const FALLBACK_MEMORY_MAX: usize = 10_000;

/// What the fallback wrote last, by object: the body's digest and the digest of the status
/// the write left. The stored status lacks the dropped fields, so a caller that compares its
/// status with the object finds a difference on every reconcile; without this memory each
/// reconcile under a lagging CRD made two writes (strict, refused; merge) and a Warning
/// event, forever.
#[derive(Debug, Default)]
pub struct FallbackMemory {
    written: std::sync::Mutex<std::collections::HashMap<String, (u64, u64)>>,
}

impl FallbackMemory {
    fn digest(v: &serde_json::Value) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        v.to_string().hash(&mut h);
        h.finish()
    }

    /// Whether `body` is what the fallback last wrote to `key`, and the object's status
    /// `seen` is still what that write left.
    fn repeats(
        &self,
        key: &str,
        body: &serde_json::Value,
        seen: Option<&serde_json::Value>,
    ) -> bool {
        let Some(seen) = seen else {
            return false;
        };
        self.written.lock().is_ok_and(|m| {
            m.get(key)
                .is_some_and(|(d, left)| *d == Self::digest(body) && *left == Self::digest(seen))
        })
    }

    fn remember(&self, key: &str, body: &serde_json::Value, left: Option<&serde_json::Value>) {
        if let Ok(mut m) = self.written.lock() {
            match left {
                Some(left) => {
                    if m.len() >= FALLBACK_MEMORY_MAX && !m.contains_key(key) {
                        m.clear();
                    }
                    m.insert(key.to_string(), (Self::digest(body), Self::digest(left)));
                }
                None => {
                    m.remove(key);
                }
            }
        }
    }
}

/// The process's memory of fallback writes (objects are named by their API path, so one
/// memory serves every caller).
fn memory() -> &'static FallbackMemory {
    static MEMORY: std::sync::OnceLock<FallbackMemory> = std::sync::OnceLock::new();
    MEMORY.get_or_init(FallbackMemory::default)
}

/// The API server's words for fields a strict write named as unknown to the installed
/// schema, or None when `e` is another error.
pub fn unknown_fields(e: &kube::Error) -> Option<String> {
    let kube::Error::Api(s) = e else {
        return None;
    };
    // An apply answers "failed to create typed patch object ...: field not declared in
    // schema" (500 today, with more codes to come); a strict update or merge patch answers
    // 400 'strict decoding error: unknown field "..."'.
    let apply = s.message.contains("field not declared in schema");
    let strict = matches!(s.code, 400 | 422) && s.message.contains("unknown field");
    (apply || strict).then(|| s.message.clone())
}

/// Applies `body` to `name`'s status as `manager`, forced (the caller owns every status
/// field it writes) and strict; on a refusal for fields the installed CRD does not know,
/// writes it as a merge patch with field validation off, so the API server drops them.
/// `seen` is the status (as JSON) the caller compared `body` with: when the fallback
/// already wrote this very body and left the status as `seen` says, nothing is sent.
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    body: &serde_json::Value,
    seen: Option<&serde_json::Value>,
) -> Result<Applied, kube::Error>
where
    K: Clone + DeserializeOwned + Debug + serde::Serialize + kube::Resource,
{
    // By object, manager and the fields written: two writers of one status (the pool
    // controller and discovery) are remembered apart.
    let fields: Vec<&str> = body["status"]
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    let key = format!(
        "{}/{name}/status:{manager}:{}",
        api.resource_url(),
        fields.join(",")
    );
    if memory().repeats(&key, body, seen) {
        return Ok(Applied::AsBefore);
    }
    let strict = PatchParams::apply(manager).force().validation_strict();
    match api.patch_status(name, &strict, &Patch::Apply(body)).await {
        Ok(_) => {
            memory().remember(&key, body, None);
            Ok(Applied::Whole)
        }
        Err(e) => {
            let Some(unknown) = unknown_fields(&e) else {
                return Err(e);
            };
            let lax = PatchParams {
                field_manager: Some(manager.to_string()),
                ..PatchParams::default()
            }
            .validation_ignore();
            let written = api.patch_status(name, &lax, &Patch::Merge(body)).await?;
            let left = serde_json::to_value(&written)
                .ok()
                .map(|v| v["status"].clone());
            memory().remember(&key, body, left.as_ref());
            Ok(Applied::Dropped(unknown))
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// `egress_status_fields_dropped_total{kind}`: status writes made without fields the
/// installed CRD lacks. Cheap to clone (shared cells).
#[derive(Clone, Debug, Default)]
pub struct SkewMetrics {
    dropped: Family<KindLabel, Counter>,
}

impl SkewMetrics {
    /// Registered as `egress_status_fields_dropped_total`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_status_fields_dropped",
            "status writes made without fields the installed CRD does not know (upgrade the CRDs)",
            m.dropped.clone(),
        );
        m
    }

    /// Counts a write of `kind` that dropped fields.
    pub fn dropped(&self, kind: &str) {
        self.dropped
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }

    /// Writes of `kind` that dropped fields (for tests).
    pub fn dropped_of(&self, kind: &str) -> u64 {
        self.dropped
            .get(&KindLabel { kind: kind.into() })
            .map_or(0, |c| c.get())
    }
}

/// The note of the Warning event that tells of dropped fields.
pub fn dropped_note(what: &str) -> String {
    format!(
        "the installed CRD does not know fields this operator writes, so they were left out \
         of the status; apply config/crd of this version: {what}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: message.into(),
            ..Default::default()
        }))
    }

    #[test]
    fn only_refusals_of_unknown_fields_are_skew() {
        let apply = "failed to create typed patch object (/p; egress-operator.dev/v1alpha1, \
                     Kind=ProxyPool): .status.newField: field not declared in schema";
        assert_eq!(
            unknown_fields(&api_error(500, apply)).as_deref(),
            Some(apply)
        );
        assert_eq!(
            unknown_fields(&api_error(422, apply)).as_deref(),
            Some(apply)
        );
        let update = "strict decoding error: unknown field \"status.newField\"";
        assert_eq!(
            unknown_fields(&api_error(400, update)).as_deref(),
            Some(update)
        );
        assert_eq!(
            unknown_fields(&api_error(422, "spec.replicas: Invalid value")),
            None
        );
        assert_eq!(unknown_fields(&api_error(409, "conflict")), None);
        assert_eq!(
            unknown_fields(&api_error(500, "etcdserver: request timed out")),
            None
        );
        assert_eq!(
            unknown_fields(&kube::Error::Service("connection refused".into())),
            None
        );
    }

    #[test]
    fn a_fallback_write_is_not_repeated_on_the_object_it_left() {
        let m = FallbackMemory::default();
        let body = serde_json::json!({"status": {"replicas": 1, "hosts": []}});
        let other = serde_json::json!({"status": {"replicas": 2, "hosts": []}});
        let left = serde_json::json!({"replicas": 1});
        let changed = serde_json::json!({"replicas": 3});
        assert!(!m.repeats("k", &body, Some(&left)), "nothing written yet");
        m.remember("k", &body, Some(&left));
        assert!(m.repeats("k", &body, Some(&left)));
        // Another body, a status changed since, an unknown status, another object: written.
        assert!(!m.repeats("k", &other, Some(&left)));
        assert!(!m.repeats("k", &body, Some(&changed)));
        assert!(!m.repeats("k", &body, None));
        assert!(!m.repeats("j", &body, Some(&left)));
        // A whole write (the CRD upgraded) forgets.
        m.remember("k", &body, None);
        assert!(!m.repeats("k", &body, Some(&left)));
    }
}
