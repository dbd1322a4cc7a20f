//! Who this cluster is, in the marks and image announcements it writes on shared hosts.
//!
//! `clusterId` is a name a person picks, and two clusters deployed from one config pick the
//! same one. The `kube-system` namespace's UID is made by the API server and cannot
//! collide, so the operator writes both and judges "ours" by both: a domain that carries
//! our `clusterId` with another cluster's UID belongs to a twin. A twin's domains are
//! never listed as ours, and a host that holds any is not collected at all (see the kvm2
//! listing), since two clusters sharing a name share nothing else safely.
//!
//! When the config sets no `clusterId`, it is derived from the UID, so a config shipped
//! to many clusters names each one differently. Outside a cluster (the CLI) there is no
//! UID: the configured `clusterId` alone is used, and marks are written without a UID.

use std::sync::OnceLock;

use crate::error::{Classified, ErrorClass};

/// The namespace whose UID identifies the cluster: every cluster has it, and nobody
/// deletes it.
pub const SYSTEM_NAMESPACE: &str = "kube-system";

/// Prefix of a `clusterId` derived from the cluster's UID.
pub const DERIVED_PREFIX: &str = "k8s-";

/// Hex digits of the UID a derived `clusterId` keeps: 48 bits, so two clusters collide
/// once in about 10^14 pairs, and the full UID in the mark decides in any case.
const DERIVED_HEX: usize = 12;

/// Why the identity is not available.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// Neither configured nor read from a cluster yet.
    #[error(
        "the cluster identity is unknown: the providers config sets no clusterId, and the {SYSTEM_NAMESPACE} namespace's UID has not been read (set clusterId to use the CLI outside a cluster)"
    )]
    Unresolved,
    /// Resolved once already, to something else.
    #[error("the cluster identity was already {was}; refusing to change it to {now}")]
    Changed {
        /// What it was.
        was: String,
        /// What was offered.
        now: String,
    },
    /// The namespace has no UID (an API server would always give one).
    #[error("the {SYSTEM_NAMESPACE} namespace has no metadata.uid")]
    NoUid,
}

impl Classified for IdentityError {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// The identity the operator writes and judges by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// `clusterId`: configured, or derived from `uid`.
    pub id: String,
    /// The `kube-system` namespace's UID; `None` outside a cluster.
    pub uid: Option<String>,
}

/// Whose a mark (or an announcement) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// This cluster's.
    Ours,
    /// Another cluster's, under another `clusterId`.
    Other,
    /// Another cluster's under *our* `clusterId`: two clusters share the name.
    Twin,
}

impl Resolved {
    /// Judges a mark that names `cluster` and, if it records one, `uid`. A mark without a
    /// UID (written by the CLI, or before UIDs were recorded) is judged by `clusterId`
    /// alone, as it always was; so is every mark when this side has no UID (the CLI).
    pub fn judge(&self, cluster: &str, uid: Option<&str>) -> Ownership {
        if cluster != self.id {
            return Ownership::Other;
        }
        match (self.uid.as_deref(), uid) {
            (Some(ours), Some(theirs)) if ours != theirs => Ownership::Twin,
            _ => Ownership::Ours,
        }
    }

    /// One line for logs and messages.
    pub fn describe(&self) -> String {
        match &self.uid {
            Some(uid) => format!("clusterId {:?} ({SYSTEM_NAMESPACE} UID {uid})", self.id),
            None => format!("clusterId {:?}", self.id),
        }
    }
}

/// The `clusterId` derived from a cluster UID: `k8s-` and the UID's first hex digits.
pub fn derive_id(uid: &str) -> String {
    let hex: String = uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .map(|c| c.to_ascii_lowercase())
        .take(DERIVED_HEX)
        .collect();
    format!("{DERIVED_PREFIX}{hex}")
}

/// The identity, set once: from the `kube-system` UID when the operator runs in a cluster,
/// else from the configured `clusterId`. Shared by everything built from one config.
#[derive(Debug, Default)]
pub struct ClusterIdentity {
    configured: Option<String>,
    resolved: OnceLock<Resolved>,
}

impl ClusterIdentity {
    /// An identity with the configured `clusterId`, if any, not yet resolved.
    pub fn new(configured: Option<String>) -> Self {
        Self {
            configured,
            resolved: OnceLock::new(),
        }
    }

    /// The configured `clusterId`.
    pub fn configured(&self) -> Option<&str> {
        self.configured.as_deref()
    }

    /// Resolves with the cluster's UID: called once the operator reaches its API server,
    /// before anything writes a mark. Calling it again with the same UID is a no-op.
    pub fn resolve_in_cluster(&self, uid: &str) -> Result<&Resolved, IdentityError> {
        if uid.is_empty() {
            return Err(IdentityError::NoUid);
        }
        let wanted = Resolved {
            id: self.configured.clone().unwrap_or_else(|| derive_id(uid)),
            uid: Some(uid.to_string()),
        };
        let got = self.resolved.get_or_init(|| wanted.clone());
        if *got == wanted {
            Ok(got)
        } else {
            Err(IdentityError::Changed {
                was: got.describe(),
                now: wanted.describe(),
            })
        }
    }

    /// The identity: resolved in a cluster, or else the configured `clusterId` alone
    /// (which then stays: a later in-cluster resolution with a UID is refused, so nothing
    /// writes marks under two identities).
    pub fn get(&self) -> Result<&Resolved, IdentityError> {
        if let Some(r) = self.resolved.get() {
            return Ok(r);
        }
        let id = self.configured.clone().ok_or(IdentityError::Unresolved)?;
        Ok(self.resolved.get_or_init(|| Resolved { id, uid: None }))
    }
}

/// Reads the cluster's UID: the `kube-system` namespace's.
pub async fn read_cluster_uid(client: &kube::Client) -> Result<String, kube::Error> {
    let api: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client.clone());
    let ns = api.get(SYSTEM_NAMESPACE).await?;
    Ok(ns.metadata.uid.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";
    const B: &str = "7f00aa01-0000-4000-8000-000000000001";

    #[test]
    fn a_twin_shares_the_name_but_not_the_uid() {
        let id = ClusterIdentity::new(Some("prod".into()));
        let me = id.resolve_in_cluster(A).unwrap();
        assert_eq!(me.judge("prod", Some(A)), Ownership::Ours);
        assert_eq!(me.judge("prod", Some(B)), Ownership::Twin);
        assert_eq!(me.judge("staging", Some(A)), Ownership::Other);
        assert_eq!(me.judge("staging", None), Ownership::Other);
        // A mark written by the CLI, or by a version before UIDs: judged by name.
        assert_eq!(me.judge("prod", None), Ownership::Ours);
    }

    #[test]
    fn without_a_configured_id_it_is_derived_from_the_uid() {
        let id = ClusterIdentity::new(None);
        assert_eq!(id.get(), Err(IdentityError::Unresolved));
        let me = id.resolve_in_cluster(A).unwrap();
        assert_eq!(me.id, "k8s-0b7c3c1e9a43");
        assert_eq!(
            crate::validation::dns1123_label(&me.id),
            Ok(()),
            "a derived clusterId is a valid one"
        );
        assert_eq!(derive_id(B), "k8s-7f00aa010000");
        assert_ne!(derive_id(A), derive_id(B));
    }

    #[test]
    fn it_is_resolved_once() {
        let id = ClusterIdentity::new(Some("prod".into()));
        id.resolve_in_cluster(A).unwrap();
        assert!(
            id.resolve_in_cluster(A).is_ok(),
            "the same UID again is fine"
        );
        let err = id.resolve_in_cluster(B).unwrap_err();
        assert!(matches!(err, IdentityError::Changed { .. }), "{err}");
        assert_eq!(id.get().unwrap().uid.as_deref(), Some(A));

        // Used offline first: the configured name alone, and a UID later is refused.
        let cli = ClusterIdentity::new(Some("prod".into()));
        assert_eq!(cli.get().unwrap().uid, None);
        assert!(cli.resolve_in_cluster(A).is_err());
        assert_eq!(
            ClusterIdentity::new(None).resolve_in_cluster(""),
            Err(IdentityError::NoUid)
        );
    }
}
