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

pub mod at_rest;
pub mod cache;
pub mod discovery;
pub mod failures;
pub mod lease;
pub mod liveness;
pub mod membership;
pub mod metrics;
pub mod plan;
pub mod pool;
pub mod split;

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

/// Reconciles each fleet controller (pools, discovery, leases) runs at once. A change of
/// a fast-probe verdict wakes every pool and every live lease; a reconcile with work to do
/// reads the API server ([`cache`]), so unbounded, one flapping proxy in a namespace with
/// 1000 leases could put 1000 reads in flight at once, for every tenant. Objects beyond
/// the bound wait in the controller's queue (one entry per object, however often it is
/// woken), so a burst costs time, not memory or API server load.
pub const RECONCILE_CONCURRENCY: u16 = 8;

/// The controller settings the fleet controllers share: see [`RECONCILE_CONCURRENCY`].
pub fn controller_config() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().concurrency(RECONCILE_CONCURRENCY)
}

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
    /// Whether its `UpToDate` condition is False: it was made from inputs the config no
    /// longer has (a plugin, an image, a machine type), so a rollout replaces it.
    pub outdated: bool,
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
            outdated: status::condition(&st, status::UP_TO_DATE)
                .is_some_and(|c| c.status == "False"),
        }
    }

    /// Whether the pool is taking it out (draining or being deleted).
    pub fn leaving(&self) -> bool {
        self.draining_since.is_some() || self.deleting
    }

    /// Whether the pool's Service sends new connections to it (its slices list it
    /// `ready`): it serves, has an address, is not leaving, and no lease holds it (a leased
    /// proxy serves its lease alone).
    pub fn serves_pool(&self) -> bool {
        self.serving && self.address.is_some() && !self.leaving() && !self.leased
    }
}

/// What the rollout floor (F2) holds at `replicas - maxUnavailable`, among the `active`
/// (not leaving) members: those the pool's Service lists ready
/// ([`Member::serves_pool`]), plus the leased members beyond `maxUnavailable`.
///
/// A leased member is out of the Service for as long as its lease holds and the pool never
/// replaces it, so leases first use up the `maxUnavailable` allowance; past it they lower
/// the floor, as the Service can never list more than the unleased members (a floor above
/// that would stall every rollout while a lease holds a proxy).
pub fn floor_count(active: &[&Member], max_unavailable: usize) -> usize {
    let serving = active.iter().filter(|m| m.serves_pool()).count();
    let leased = active.iter().filter(|m| m.leased).count();
    serving + leased.saturating_sub(max_unavailable)
}

/// A fleet object watched one object at a time (issue 33, item 10): one this binary
/// cannot decode is reported on `/readyz` and left out; the others are reconciled.
pub(crate) trait Watched:
    kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned + Send + 'static
{
    /// How logs, metrics and `/readyz` name it.
    const RESOURCE: &'static str;
    /// The object with only `meta`: what a deleted object the watch could not decode
    /// leaves the cache as (the cache drops it by name).
    fn stub(meta: kube::api::ObjectMeta) -> Self;
}

impl Watched for crate::api::proxy_pool::ProxyPool {
    const RESOURCE: &'static str = "proxypool";
    fn stub(meta: kube::api::ObjectMeta) -> Self {
        let mut p = Self::new("", Default::default());
        p.metadata = meta;
        p
    }
}

impl Watched for crate::api::proxy_lease::ProxyLease {
    const RESOURCE: &'static str = "proxylease";
    fn stub(meta: kube::api::ObjectMeta) -> Self {
        let mut l = Self::new("", Default::default());
        l.metadata = meta;
        l
    }
}

/// Every `K` of the cluster, watched as [`Watched`] says; `health` is told of failures.
pub(crate) fn events<K: Watched>(
    client: kube::Client,
    health: crate::controller::watch::WatchHealth,
) -> impl futures_util::Stream<
    Item = Result<kube::runtime::watcher::Event<K>, kube::runtime::watcher::Error>,
> + Send
+ 'static {
    crate::controller::watch::decoded(
        client,
        kube::runtime::watcher::Config::default().any_semantic(),
        health,
        K::RESOURCE,
        K::stub,
    )
}

/// The label selector of a pool's Proxies.
pub fn pool_selector(pool: &str) -> String {
    format!("{POOL_LABEL}={pool}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::plan::{HostSlot, PoolShape, plan};
    use super::*;

    fn member(name: &str, hash: &str, serving: bool, leased: bool) -> Member {
        Member {
            name: name.into(),
            uid: format!("uid-{name}"),
            address: Some("192.0.2.1".parse().unwrap()),
            host: Some("h1".into()),
            created: jiff::Timestamp::UNIX_EPOCH,
            template_hash: Some(hash.into()),
            draining_since: None,
            leased,
            deleting: false,
            ready: serving,
            serving,
            failed: false,
            not_serving_since: None,
            outdated: false,
        }
    }

    fn shape(replicas: usize, max_unavailable: usize) -> PoolShape {
        PoolShape {
            replicas,
            max_surge: 1,
            max_unavailable,
            drain: Duration::from_secs(10),
            template_hash: "new".into(),
            replace_after: Duration::ZERO,
            creates: super::plan::CreateGate::Open,
            progress_deadline: Duration::ZERO,
        }
    }

    fn hosts() -> Vec<HostSlot> {
        vec![HostSlot {
            name: "h1".into(),
            healthy: true,
            room: 10,
        }]
    }

    #[test]
    fn a_leased_member_does_not_serve_the_pool() {
        let free = member("a", "new", true, false);
        assert!(free.serves_pool());
        assert!(!member("b", "new", true, true).serves_pool());
        assert!(!member("c", "new", false, false).serves_pool());
        let mut draining = free.clone();
        draining.draining_since = Some(jiff::Timestamp::UNIX_EPOCH);
        assert!(!draining.serves_pool());
    }

    /// Before F2 counted what the Service serves, the leased member (serving its lease)
    /// made the floor look met, and the Service's only proxy was drained at once.
    #[test]
    fn the_rollout_floor_counts_what_the_pools_service_serves() {
        let now = jiff::Timestamp::UNIX_EPOCH;
        // replicas 2, maxUnavailable 1: one proxy is leased, the other (old template)
        // is the only one the pool's Service lists.
        let members = [
            member("leased", "new", true, true),
            member("old", "old", true, false),
        ];
        let p = plan(&shape(2, 1), &members, &hosts(), now);
        assert!(
            p.drain.is_empty() && p.delete.is_empty(),
            "the Service's only proxy goes before its replacement serves: {p:?}"
        );
        assert_eq!(p.create.len(), 1, "{p:?}");
        // Once the replacement serves, the old one is drained.
        let mut members = members.to_vec();
        members.push(member("fresh", "new", true, false));
        let p = plan(&shape(2, 1), &members, &hosts(), now);
        assert_eq!(p.drain, ["old"]);
    }

    #[test]
    fn leases_beyond_max_unavailable_lower_the_floor_so_a_rollout_never_stalls() {
        let now = jiff::Timestamp::UNIX_EPOCH;
        // replicas 3, maxUnavailable 0, two leased (one of them not serving): the Service
        // can list at most one unleased member, so a serving replacement lets the old go.
        let members = [
            member("l1", "new", true, true),
            member("l2", "new", false, true),
            member("old", "old", true, false),
            member("fresh", "new", true, false),
        ];
        let active: Vec<&Member> = members.iter().collect();
        assert_eq!(floor_count(&active, 0), 4);
        assert_eq!(floor_count(&active, 1), 3);
        let p = plan(&shape(3, 0), &members, &hosts(), now);
        assert_eq!(p.drain, ["old"], "{p:?}");
    }
}
