//! Leasing: a `ProxyLease` holds proxies of a pool exclusively, is renewed by its holder or
//! expires, and is rebound to a spare when a bound proxy stops serving.
//!
//! - [`binding`]: the pure rules (what to keep, lose, claim, take and give back), tested
//!   without an API server.
//! - [`controller`]: the reconcile that applies them with guarded writes (the lease's and
//!   each Proxy's resourceVersion), so racing reconciles (two replicas around a handover,
//!   stale caches) never bind one proxy twice (invariant F1).
//! - [`service`]: the lease's own selector-less Service and EndpointSlices.
//! - [`view`]: what a reconcile reads, from the caches at rest and fresh before a write.
//! - [`metrics`]: leases by phase, time to bind, pending time, rebinds, expiries.
//!
//! Like the rest of the fleet, this writes only Kubernetes objects. A released proxy is
//! recycled through its pool: with `Replace` the lease marks it draining and the pool
//! deletes it and makes a fresh one; with `Reuse` the lease only clears its label.

pub mod binding;
pub mod controller;
pub mod metrics;
pub mod service;
pub mod surge;
pub mod view;

pub use controller::{LeaseContext, SweepReport, reconcile, run, sweep_orphans};
pub use metrics::LeaseMetrics;

use crate::error::{Classified, ErrorClass};

/// Why a lease reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The Kubernetes API failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The lease lacks something the API server always sets.
    #[error("the ProxyLease has no {0}")]
    Incomplete(&'static str),
    /// The lease's name cannot name its Service or EndpointSlices.
    #[error("lease name {name:?}: {why}")]
    BadName {
        /// The name.
        name: String,
        /// Why it does not fit.
        why: &'static str,
    },
    /// Giving a proxy back kept losing to other writes.
    #[error("proxy {0}: its resourceVersion kept changing while the lease released it")]
    Contended(String),
}

impl Classified for LeaseError {
    fn class(&self) -> ErrorClass {
        match self {
            LeaseError::Kube(e) => crate::error::kube_error_class(e),
            LeaseError::Contended(_) => ErrorClass::Transient,
            LeaseError::Incomplete(_) | LeaseError::BadName { .. } => ErrorClass::Permanent,
        }
    }
}

/// Checks that the lease's name can name its Service (a DNS-1035 label) and slices, with
/// discovery's rule.
pub fn check_name(name: &str) -> Result<(), LeaseError> {
    super::discovery::check_name(name).map_err(|e| match e {
        super::FleetError::BadName { name, why } => LeaseError::BadName { name, why },
        _ => LeaseError::BadName {
            name: name.to_string(),
            why: "cannot name a Service",
        },
    })
}
