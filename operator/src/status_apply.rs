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
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    body: &serde_json::Value,
) -> Result<Applied, kube::Error>
where
    K: Clone + DeserializeOwned + Debug,
{
    let strict = PatchParams::apply(manager).force().validation_strict();
    match api.patch_status(name, &strict, &Patch::Apply(body)).await {
        Ok(_) => Ok(Applied::Whole),
        Err(e) => {
            let Some(unknown) = unknown_fields(&e) else {
                return Err(e);
            };
            let lax = PatchParams {
                field_manager: Some(manager.to_string()),
                ..PatchParams::default()
            }
            .validation_ignore();
            api.patch_status(name, &lax, &Patch::Merge(body)).await?;
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
}
