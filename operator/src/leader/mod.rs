//! Leader election over a `coordination.k8s.io/v1` Lease, so that two replicas can run and
//! only one reconciles.
//!
//! The protocol is client-go's, and ours (it replaced `kube-lease-manager`, whose forced
//! release of an expired lease was an unconditional patch: two followers that both saw the
//! lease expire could wipe the hold one of them had just taken, and both would lead):
//!
//! - every write is an update carrying the `resourceVersion` of the read it is based on, so
//!   a write based on a stale read fails with a conflict instead of overwriting someone
//!   else's hold; the writer re-reads at once and judges again from what it finds;
//! - a follower takes a held lease only after it has seen the same *holder record*
//!   (holder, acquire and renew times, duration, transitions), unchanged, for the lease
//!   duration by its own clock (so clock skew between nodes does not matter), and a free
//!   one (released) at once. A new `resourceVersion` alone (an annotation, a label, a
//!   no-op write) is not a renewal: otherwise anything touching the Lease every few seconds
//!   would keep a dead holder in place forever;
//! - the holder renews every `lease_duration - renew_before_expiry`; a renewal that fails
//!   (an error, a timeout, a conflict) is retried until the *renew deadline*,
//!   [`LeaderOptions::fencing_margin`] before its lease could expire in any follower's eyes,
//!   counted from the *start* of the last renewal that succeeded (the record a follower
//!   times was written after that start). Only then does it step down, so a blip (a 429,
//!   a 5xx, a dropped connection, someone touching the Lease) costs nothing, and a deposed
//!   replica has still stopped at least the margin before any follower can take over: the
//!   margin is what it has to cut its provider calls off (see `run`). A read that names
//!   another holder is a loss at once;
//! - a follower re-reads every [`LeaderOptions::retry_period`], so a released lease is
//!   taken within it;
//! - release on shutdown (clear the holder, also guarded), bounded by a timeout.
//!
//! Around it: a state channel that is `true` only while we hold the lease, wrapped in
//! [`Leadership`] with [`Leadership::acquired`] and [`Leadership::lost`].
//!
//! Modules: `lease` (the Lease API as the elector uses it, and the holder record),
//! `elector` (the background loop: renew, retry, step down, release). What a replica does
//! when it steps down (the fence on its provider calls, the cut, the new term) lives with
//! the providers (`provider::decorate`) and the term runner (`run`).
//!
//! Typical use in the binary:
//!
//! ```no_run
//! # async fn run(client: kube::Client) -> Result<(), egress_operator::leader::LeaderError> {
//! use egress_operator::leader::{resolve_identity, LeaderElector, LeaderOptions};
//!
//! let options = LeaderOptions::new("egress-system", resolve_identity()?);
//! let (mut leadership, elector) = LeaderElector::start(client, options).await?;
//! leadership.acquired().await?;
//! // Start the controllers here, then stop them as soon as this resolves:
//! leadership.lost().await;
//! // ... or on SIGTERM: stop the controllers first, then hand the lease over at once.
//! elector.shutdown().await?;
//! # Ok(())
//! # }
//! ```

mod elector;
mod lease;
#[cfg(test)]
mod tests;

use std::time::Duration;

use kube::Client;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::error::{Classified, ErrorClass};
pub use elector::LeaderMetrics;
use elector::Runner;
use lease::LeaseApi;

/// Lease name both replicas agree on unless configured otherwise.
pub const DEFAULT_LEASE_NAME: &str = "egress-operator";
/// client-go's default: long enough to ride out an API server restart, short enough that a
/// crashed leader is replaced within seconds.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// The holder renews this long before expiry: every 5 s with the default duration. A
/// failed renewal is retried for half of it (the other half is the fencing margin), so the
/// renew deadline is 10 s after the last good renewal began, as client-go's default.
pub const DEFAULT_RENEW_BEFORE_EXPIRY: Duration = Duration::from_secs(10);
/// How often a follower re-reads the lease (client-go's retry period).
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);
/// Shutdown must not hang on an unreachable API server.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Our field manager on the Lease is this plus the identity: unique per replica, and
/// readable in `managedFields` (who wrote the lease last).
const FIELD_MANAGER_PREFIX: &str = "egress-operator-leader-";

/// Where the lease lives, who we are, and the timing of the election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderOptions {
    /// Namespace of the Lease (the operator's own namespace).
    pub namespace: String,
    /// Name of the Lease; every replica must use the same one.
    pub lease_name: String,
    /// Unique per replica (the pod name): two replicas with one identity would both lead.
    pub identity: String,
    /// How long a lease stays valid after its last renewal. Whole seconds (the Lease API
    /// counts in seconds), at least 2.
    pub lease_duration: Duration,
    /// The holder renews this long before expiry. Whole seconds, at least 1 and less than
    /// `lease_duration`. Half of it is the fencing margin (see
    /// [`LeaderOptions::fencing_margin`]); the other half is how long a failed renewal is
    /// retried (see [`LeaderOptions::renew_deadline`]).
    pub renew_before_expiry: Duration,
    /// How often a follower re-reads the lease; bounds takeover after a graceful release.
    /// Also the longest wait between two tries of a failed renewal.
    pub retry_period: Duration,
    /// Bound on releasing the lease at shutdown.
    pub release_timeout: Duration,
}

impl LeaderOptions {
    /// Options with the default lease name and timing.
    pub fn new(namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        LeaderOptions {
            namespace: namespace.into(),
            lease_name: DEFAULT_LEASE_NAME.to_string(),
            identity: identity.into(),
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_before_expiry: DEFAULT_RENEW_BEFORE_EXPIRY,
            retry_period: DEFAULT_RETRY_PERIOD,
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
        }
    }

    /// The least time between the holder stepping down and any follower taking the lease
    /// over: half of `renew_before_expiry` (5 s by default). The holder steps down at the
    /// latest this long before its lease could expire, so a deposed replica has this long
    /// to stop what it started; the other half is what a renewal may take, retries
    /// included.
    pub fn fencing_margin(&self) -> Duration {
        self.renew_before_expiry / 2
    }

    /// How long after the start of its last good renewal the holder keeps trying to renew
    /// before it steps down: `lease_duration - fencing_margin` (10 s by default, client-go's
    /// `RenewDeadline`). A renewal is due `lease_duration - renew_before_expiry` after that
    /// start (5 s by default), so a failing one has the rest (5 s) for its retries.
    pub fn renew_deadline(&self) -> Duration {
        self.lease_duration.saturating_sub(self.fencing_margin())
    }

    /// Checks the options: names set, timings that can work.
    pub fn validate(&self) -> Result<(), LeaderError> {
        self.seconds().map(|_| ())
    }

    /// Lease duration and renew-before-expiry in whole seconds (the Lease API counts in
    /// seconds).
    fn seconds(&self) -> Result<(u64, u64), LeaderError> {
        let invalid = |reason: String| Err(LeaderError::InvalidOptions(reason));
        for (what, value) in [
            ("namespace", &self.namespace),
            ("lease name", &self.lease_name),
            ("identity", &self.identity),
        ] {
            if value.trim().is_empty() {
                return invalid(format!("{what} is empty"));
            }
        }
        for (what, value) in [
            ("lease duration", self.lease_duration),
            ("renew before expiry", self.renew_before_expiry),
        ] {
            if value.subsec_nanos() != 0 {
                return invalid(format!("{what} {value:?} is not a whole number of seconds"));
            }
        }
        let duration = self.lease_duration.as_secs();
        let grace = self.renew_before_expiry.as_secs();
        if duration < 2 {
            return invalid(format!("lease duration {duration}s is shorter than 2s"));
        }
        if grace == 0 || grace >= duration {
            return invalid(format!(
                "renew before expiry {grace}s must be at least 1s and less than the lease duration {duration}s"
            ));
        }
        if self.retry_period.is_zero() || self.retry_period >= self.lease_duration {
            return invalid(format!(
                "retry period {:?} must be positive and shorter than the lease duration",
                self.retry_period
            ));
        }
        if self.release_timeout.is_zero() {
            return invalid("release timeout is zero".to_string());
        }
        Ok((duration, grace))
    }
}

/// Our identity for the election: `POD_NAME` (set from the downward API) if present, else
/// the host name, which is the pod name inside a pod.
pub fn resolve_identity() -> Result<String, LeaderError> {
    identity_from(std::env::var("POD_NAME").ok(), host_name())
}

fn identity_from(
    pod_name: Option<String>,
    host_name: Option<String>,
) -> Result<String, LeaderError> {
    [pod_name, host_name]
        .into_iter()
        .flatten()
        .map(|s| s.trim().to_string())
        .find(|s| !s.is_empty())
        .ok_or(LeaderError::NoIdentity)
}

fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
}

/// Leader election failures.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The options cannot work (see [`LeaderOptions::validate`]).
    #[error("invalid leader election options: {0}")]
    InvalidOptions(String),
    /// Neither `POD_NAME` nor a host name is set.
    #[error("no identity for leader election: set POD_NAME or a host name")]
    NoIdentity,
    /// The Lease API refused or failed.
    #[error("lease {namespace}/{name}: {source}")]
    Lease {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// What the API server answered.
        #[source]
        source: kube::Error,
    },
    /// Releasing the lease at shutdown took too long; the other replica takes over once
    /// the lease expires instead.
    #[error("releasing lease {namespace}/{name} timed out after {timeout:?}")]
    ReleaseTimeout {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// The configured bound.
        timeout: Duration,
    },
    /// The elector stopped (shut down or aborted) before we became leader.
    #[error("leader election stopped")]
    Stopped,
    /// The elector's task panicked or was aborted.
    #[error("leader election task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

impl Classified for LeaderError {
    fn class(&self) -> ErrorClass {
        match self {
            LeaderError::InvalidOptions(_) | LeaderError::NoIdentity => ErrorClass::Permanent,
            LeaderError::Lease { source, .. } => crate::error::kube_error_class(source),
            LeaderError::ReleaseTimeout { .. } => ErrorClass::Transient,
            LeaderError::Stopped | LeaderError::Task(_) => ErrorClass::Permanent,
        }
    }
}

/// Read side of the election: whether we hold the lease now, and futures for the moments
/// it changes. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Leadership {
    rx: watch::Receiver<bool>,
}

impl Leadership {
    /// True while we hold the lease. False once the elector has stopped, whatever it
    /// last published (an aborted elector cannot publish `false`).
    pub fn is_leader(&self) -> bool {
        let leading = *self.rx.borrow();
        leading && self.rx.has_changed().is_ok()
    }

    /// Resolves once we hold the lease (at once if we already do). Fails if the elector
    /// stopped first.
    pub async fn acquired(&mut self) -> Result<(), LeaderError> {
        loop {
            let leading = *self.rx.borrow_and_update();
            if leading && self.rx.has_changed().is_ok() {
                return Ok(());
            }
            if self.rx.changed().await.is_err() {
                return Err(LeaderError::Stopped);
            }
        }
    }

    /// Resolves once we no longer hold the lease (at once if we do not): lost to another
    /// replica, stepped down after an API error, or the elector stopped. Reconciling must
    /// stop when it resolves.
    pub async fn lost(&mut self) {
        loop {
            let leading = *self.rx.borrow_and_update();
            if !leading || self.rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// The raw channel (`true` while leading), for callers that `select!` on changes. Its
    /// last value stays `true` if the elector is aborted; [`Leadership::is_leader`] does not.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }

    /// The fence providers check before acting: held exactly while [`Leadership::is_leader`].
    pub fn fence(&self) -> crate::provider::Fence {
        crate::provider::Fence::new(self.rx.clone())
    }
}

///
/// The task publishes `true` only after the API confirmed we hold the lease, and `false`
/// before any point where that may no longer be so: when a read names another holder, and
/// when no renewal succeeded by the renew deadline ([`LeaderOptions::renew_deadline`]).
/// A failed renewal before that deadline is retried and publishes nothing, so a blip costs
/// the caller nothing. After a step-down the elector re-reads the lease and, if it still
/// names us, leads again (a new term for the caller); never two leaders.
///
/// Dropping the handle shuts the elector down as [`LeaderElector::shutdown`] does, without
/// waiting for the release.
#[derive(Debug)]
pub struct LeaderElector {
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), LeaderError>>,
}

impl LeaderElector {
    /// Validates the options, makes sure the Lease exists (creating it if needed; an RBAC
    /// or API failure is reported here rather than retried forever) and starts electing.
    pub async fn start(
        client: Client,
        options: LeaderOptions,
    ) -> Result<(Leadership, LeaderElector), LeaderError> {
        Self::start_with_metrics(client, options, LeaderMetrics::default()).await
    }

    /// [`LeaderElector::start`], counting retried renewals and step-downs in `metrics`.
    pub async fn start_with_metrics(
        client: Client,
        options: LeaderOptions,
        metrics: LeaderMetrics,
    ) -> Result<(Leadership, LeaderElector), LeaderError> {
        let (duration, grace) = options.seconds()?;
        let runner = Runner::new(
            LeaseApi::new(client, &options, duration),
            options,
            Duration::from_secs(duration.saturating_sub(grace).max(1)),
            metrics,
        );
        runner.reach().await?;
        let (tx, rx) = watch::channel(false);
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let task = tokio::spawn(runner.run(tx, shutdown_rx));
        Ok((
            Leadership { rx },
            LeaderElector {
                shutdown: Some(shutdown_tx),
                task,
            },
        ))
    }

    /// Steps down (publishing `false`), releases the lease so the other replica takes over
    /// within its retry period rather than after expiry, and waits for the task to end.
    /// Stop reconciling before calling this.
    pub async fn shutdown(mut self) -> Result<(), LeaderError> {
        if let Some(tx) = self.shutdown.take() {
            // Err: the task has already ended; its result is below.
            let _ = tx.send(());
        }
        (&mut self.task).await.map_err(LeaderError::Task)?
    }

    /// Stops the elector at once without releasing the lease, as a crash would: the other
    /// replica takes over only when the lease expires. For tests, and for a process that
    /// cannot wait.
    pub fn abort(&self) {
        self.task.abort();
    }

    /// True once the background task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}
