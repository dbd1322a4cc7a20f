//! The fleet: pools of Proxies and their discovery. These parts consume Proxy objects and
//! their status and write only Kubernetes objects (Proxies, Services, EndpointSlices,
//! pool status); they never call a provider, so nothing here imports `crate::provider`.
//! The Proxy controller stays the only code that creates or deletes a VM.
//!
//! - [`pool`]: the `ProxyPool` controller. It keeps `replicas` Proxies spread over the
//!   usable hosts ([`plan`], pure and tested with paused time), rolls a template change
//!   surge-first, and scales in non-serving Proxies first, then the newest, never a leased
//!   one.
//! - [`discovery`]: per pool a selector-less Service and one EndpointSlice per address
//!   family that list only the Proxies serving now; the same list goes to the pool's
//!   status.
//! - [`lease`]: the `ProxyLease` controller: binds serving, unleased proxies of a pool to
//!   a lease exclusively (both sides point at each other by UID, every taking write
//!   guarded by resourceVersion), expires unrenewed leases, rebinds lost proxies, and
//!   keeps a Service per lease.
//! - [`liveness`]: the fast signal discovery needs (a CONNECT every second per pool
//!   Proxy), with a guard that keeps the last known endpoints when every proxy fails at
//!   once (the operator's own path is then the likelier culprit).
//!
//! One view of a pool member ([`Member`]) is shared by the pool and discovery, so what the
//! pool counts as serving is exactly what the EndpointSlices list.

pub mod discovery;
pub mod lease;
pub mod liveness;
pub mod metrics;
pub mod plan;
pub mod pool;

#[cfg(test)]
mod sim;

use std::net::IpAddr;

use kube::ResourceExt;

use crate::api::proxy::Proxy;
use crate::api::proxy_pool::{DRAINING_ANNOTATION, LEASE_LABEL, POOL_LABEL, TEMPLATE_HASH_LABEL};
use crate::controller::status;
use crate::error::{Classified, ErrorClass};

pub use liveness::LivenessBoard;
pub use metrics::FleetMetrics;

/// Field manager of the fleet's server-side applies (Services, EndpointSlices).
pub const FIELD_MANAGER: &str = "egress-operator-fleet";

/// Why a fleet reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The Kubernetes API failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The pool object lacks something the API server always sets.
    #[error("the ProxyPool has no {0}")]
    Incomplete(&'static str),
    /// The pool's name cannot name its Service or EndpointSlices.
    #[error("pool name {name:?}: {why}")]
    BadName {
        /// The name.
        name: String,
        /// Why it does not fit.
        why: &'static str,
    },
}

impl Classified for FleetError {
    fn class(&self) -> ErrorClass {
        match self {
            FleetError::Kube(e) => crate::error::kube_error_class(e),
            FleetError::Incomplete(_) | FleetError::BadName { .. } => ErrorClass::Permanent,
        }
    }
}

/// One Proxy of a pool as the fleet sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// Proxy name.
    pub name: String,
    /// Proxy UID.
    pub uid: String,
    /// Its published address.
    pub address: Option<IpAddr>,
    /// Host it runs on (status), else the host it is pinned to (spec).
    pub host: Option<String>,
    /// Creation time (the newest is scaled in first among serving ones).
    pub created: jiff::Timestamp,
    /// The template hash it was made from.
    pub template_hash: Option<String>,
    /// When the pool began draining it.
    pub draining_since: Option<jiff::Timestamp>,
    /// Whether a lease holds it (the pool never takes it away).
    pub leased: bool,
    /// Whether it is being deleted.
    pub deleting: bool,
    /// Whether its `Ready` condition is True (the slow, thorough probe and the VM state).
    pub ready: bool,
    /// Whether it serves now: the fast liveness verdict when there is one, else `ready`.
    pub serving: bool,
    /// Whether the Proxy controller gave up on it (`phase: Failed`, a permanent error).
    pub failed: bool,
    /// Since when its `Serving` condition is False (for replacing a proxy that never
    /// comes back).
    pub not_serving_since: Option<jiff::Timestamp>,
}

impl Member {
    /// Reads a Proxy, with the liveness verdict from `board`.
    pub fn of(proxy: &Proxy, board: &LivenessBoard) -> Self {
        let st = proxy.status.clone().unwrap_or_default();
        let address = st.address.as_deref().and_then(|a| a.parse::<IpAddr>().ok());
        let uid = proxy.uid().unwrap_or_default();
        let ready = status::is_ready(&st);
        let serving_cond = status::condition(&st, status::SERVING);
        // The thorough probe found a proxy that answers but cannot reach the target: the
        // fast probe (any answer passes) must not list it.
        let target_refused =
            serving_cond.is_some_and(|c| c.status == "False" && c.reason == "TargetRefused");
        let deleting = proxy.metadata.deletion_timestamp.is_some();
        let serving = match (address, deleting) {
            (Some(ip), false) => match board.verdict(&uid, ip) {
                Some(up) => up && !target_refused,
                None => ready,
            },
            _ => false,
        };
        let not_serving_since = serving_cond
            .filter(|c| c.status == "False")
            .map(|c| c.last_transition_time.0);
        let annotations = proxy.annotations();
        let labels = proxy.labels();
        Self {
            name: proxy.name_any(),
            uid,
            address,
            host: st.host.clone().or_else(|| proxy.spec.host.clone()),
            created: proxy
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(jiff::Timestamp::UNIX_EPOCH, |t| t.0),
            template_hash: labels.get(TEMPLATE_HASH_LABEL).cloned(),
            draining_since: annotations
                .get(DRAINING_ANNOTATION)
                .and_then(|t| t.parse().ok()),
            leased: labels.get(LEASE_LABEL).is_some_and(|v| !v.is_empty()),
            deleting,
            ready,
            serving,
            failed: st.phase == Some(crate::api::proxy::ProxyPhase::Failed),
            not_serving_since,
        }
    }

    /// Whether the pool is taking it out (draining or being deleted).
    pub fn leaving(&self) -> bool {
        self.draining_since.is_some() || self.deleting
    }
}

/// The label selector of a pool's Proxies.
pub fn pool_selector(pool: &str) -> String {
    format!("{POOL_LABEL}={pool}")
}
