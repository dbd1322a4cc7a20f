//! Leader election over a `coordination.k8s.io/v1` Lease, so that two replicas can run and
//! only one reconciles.
//!
//! The protocol is client-go's, and ours (it replaced `kube-lease-manager`, whose forced
//! release of an expired lease was an unconditional patch: two followers that both saw the
//! lease expire could wipe the hold one of them had just taken, and both would lead):
//!
//! - every write is an update carrying the `resourceVersion` of the read it is based on, so
//!   a write based on a stale read fails with a conflict instead of overwriting someone
//!   else's hold; the loser re-reads and follows;
//! - a follower takes a held lease only after it has seen the same record, unchanged, for
//!   the lease duration by its own clock (so clock skew between nodes does not matter),
//!   and a free one (released) at once;
//! - the holder renews every `lease_duration - renew_before_expiry` and steps down when a
//!   renewal fails or has not succeeded by [`LeaderOptions::fencing_margin`] before its
//!   lease could expire in any follower's eyes, counted from the *start* of the last
//!   renewal that succeeded (the record a follower times was written after that start), so
//!   it has stopped at least the margin before any follower can take over: the margin is
//!   what the deposed replica has to cut its provider calls off (see `run`);
//! - a follower re-reads every [`LeaderOptions::retry_period`], so a released lease is
//!   taken within it;
//! - release on shutdown (clear the holder, also guarded), bounded by a timeout.
//!
//! Around it: a state channel that is `true` only while we hold the lease, wrapped in
//! [`Leadership`] with [`Leadership::acquired`] and [`Leadership::lost`].
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

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::error::{Classified, ErrorClass};

/// Lease name both replicas agree on unless configured otherwise.
pub const DEFAULT_LEASE_NAME: &str = "egress-operator";
/// client-go's default: long enough to ride out an API server restart, short enough that a
/// crashed leader is replaced within seconds.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// The holder renews this long before expiry: every 5 s with the default duration, which
/// leaves room for a slow request; also how long a renewal may take before the holder
/// steps down.
pub const DEFAULT_RENEW_BEFORE_EXPIRY: Duration = Duration::from_secs(10);
/// How often a follower re-reads the lease (client-go's retry period).
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);
/// Shutdown must not hang on an unreachable API server.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Our field manager on the Lease is this plus the identity: unique per replica, and
/// readable in `managedFields` (who wrote the lease last).
const FIELD_MANAGER_PREFIX: &str = "egress-operator-leader-";

/// First wait after an API error; doubles up to the lease duration.
const FIRST_ERROR_BACKOFF: Duration = Duration::from_millis(500);

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
    /// [`LeaderOptions::fencing_margin`]).
    pub renew_before_expiry: Duration,
    /// How often a follower re-reads the lease; bounds takeover after a graceful release.
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
    /// to stop what it started; the other half is what a renewal may take.
    pub fn fencing_margin(&self) -> Duration {
        self.renew_before_expiry / 2
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

/// Handle on the background task that acquires and keeps the lease.
///
/// The task publishes `true` only after the API confirmed we hold the lease, and `false`
/// before any point where that may no longer be so. In particular a failed or slow
/// renewal counts as losing the lease at once. The elector then re-reads the lease and, if
/// it still names us, leads again; a blip costs the caller one restart of its reconcilers,
/// never two leaders.
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
        let (duration, grace) = options.seconds()?;
        let runner = Runner {
            api: LeaseApi::new(client, &options, duration),
            lease: format!("{}/{}", options.namespace, options.lease_name),
            renew_every: Duration::from_secs(duration.saturating_sub(grace).max(1)),
            options,
        };
        runner
            .api
            .read_or_create()
            .await
            .map_err(|e| runner.error(e))?;
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

/// The Lease API as the elector uses it: read, create, and update guarded by the
/// `resourceVersion` of the read.
struct LeaseApi {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration_secs: i32,
    params: PostParams,
}

/// What a replica last read of the lease and when it first saw that version, by its own
/// clock: a held lease counts as expired once the same version has been seen for its
/// duration, whatever the holder's clock wrote in `renewTime`.
#[derive(Default)]
struct Observed {
    version: Option<String>,
    since: Option<Instant>,
}

impl Observed {
    fn saw(&mut self, lease: &Lease) {
        let version = lease.metadata.resource_version.clone();
        if version != self.version || self.since.is_none() {
            self.version = version;
            self.since = Some(Instant::now());
        }
    }

    fn expired(&self, spec: &LeaseSpec) -> bool {
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(0);
        self.since
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(duration))
    }
}

/// The holder, unless the lease names none.
fn holder_of(spec: &LeaseSpec) -> Option<&str> {
    spec.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// The API server refused who we are or what we asked (401, 403).
fn is_refusal(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 401 || s.code == 403)
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl LeaseApi {
    fn new(client: Client, options: &LeaderOptions, duration_secs: u64) -> Self {
        let params = PostParams {
            field_manager: Some(format!("{FIELD_MANAGER_PREFIX}{}", options.identity)),
            ..PostParams::default()
        };
        Self {
            api: Api::namespaced(client, &options.namespace),
            name: options.lease_name.clone(),
            identity: options.identity.clone(),
            duration_secs: i32::try_from(duration_secs).unwrap_or(i32::MAX),
            params,
        }
    }

    /// Reads the lease, creating it free when missing (another replica creating it first
    /// is fine).
    async fn read_or_create(&self) -> Result<Lease, kube::Error> {
        if let Some(lease) = self.api.get_opt(&self.name).await? {
            return Ok(lease);
        }
        let empty = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec::default()),
        };
        match self.api.create(&self.params, &empty).await {
            Ok(lease) => Ok(lease),
            Err(e) if is_conflict(&e) => self.api.get(&self.name).await,
            Err(e) => Err(e),
        }
    }

    /// Writes `spec` over `read`, only if nobody wrote the lease since; `None` if someone
    /// did (the caller re-reads).
    async fn write(&self, read: &Lease, spec: LeaseSpec) -> Result<Option<Lease>, kube::Error> {
        let mut next = read.clone();
        next.metadata.managed_fields = None;
        next.spec = Some(spec);
        match self.api.replace(&self.name, &self.params, &next).await {
            Ok(lease) => Ok(Some(lease)),
            Err(e) if is_conflict(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// One round: take the lease if it is free, expired or ours (renewing it), from what
    /// was just read. True if we hold it now.
    async fn acquire_or_renew(&self, observed: &mut Observed) -> Result<bool, kube::Error> {
        let lease = self.read_or_create().await?;
        observed.saw(&lease);
        self.take(&lease, observed).await
    }

    /// The write half of [`LeaseApi::acquire_or_renew`], based on `lease` as read.
    async fn take(&self, lease: &Lease, observed: &mut Observed) -> Result<bool, kube::Error> {
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = holder_of(&spec);
        let ours = holder == Some(self.identity.as_str());
        if holder.is_some() && !ours && !observed.expired(&spec) {
            return Ok(false);
        }
        let now = MicroTime(jiff::Timestamp::now());
        let next = LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration_secs),
            renew_time: Some(now.clone()),
            acquire_time: if ours {
                spec.acquire_time.clone()
            } else {
                Some(now)
            },
            lease_transitions: if ours || holder.is_none() && spec.lease_transitions.is_none() {
                spec.lease_transitions
            } else {
                Some(spec.lease_transitions.unwrap_or(0).saturating_add(1))
            },
            ..spec
        };
        match self.write(lease, next).await? {
            Some(written) => {
                observed.saw(&written);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Clears the holder if it is us; someone else's lease is left alone.
    async fn release(&self) -> Result<(), kube::Error> {
        let Some(lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if holder_of(&spec) != Some(self.identity.as_str()) {
            return Ok(());
        }
        let cleared = LeaseSpec {
            holder_identity: None,
            acquire_time: None,
            renew_time: None,
            lease_duration_seconds: None,
            ..spec
        };
        // A conflict: someone wrote since, so it is not ours any more.
        self.write(&lease, cleared).await.map(|_| ())
    }
}

/// The background task's state.
struct Runner {
    api: LeaseApi,
    options: LeaderOptions,
    /// `namespace/name`, for logs.
    lease: String,
    /// How often the holder renews: `lease_duration - renew_before_expiry`.
    renew_every: Duration,
}

impl Runner {
    fn error(&self, source: kube::Error) -> LeaderError {
        LeaderError::Lease {
            namespace: self.options.namespace.clone(),
            name: self.options.lease_name.clone(),
            source,
        }
    }

    async fn run(
        self,
        tx: watch::Sender<bool>,
        mut shutdown: oneshot::Receiver<()>,
    ) -> Result<(), LeaderError> {
        let identity = self.options.identity.as_str();
        let lease = self.lease.as_str();
        let mut backoff = FIRST_ERROR_BACKOFF;
        let max_backoff = self.options.lease_duration;
        let mut observed = Observed::default();
        // Whether the Lease was ever read or written: until then a refusal (401/403) is a
        // misconfiguration (a Lease name or namespace the Role does not cover, a missing
        // binding) that retrying cannot fix, so the elector fails and the process exits
        // naming the Lease, instead of standing by forever.
        let mut reached = false;
        // Start of the last attempt that took or renewed the lease: the record a follower
        // times was written after it, so the lease cannot expire in a follower's eyes before
        // `held_since + lease_duration`.
        let mut held_since: Option<tokio::time::Instant> = None;
        loop {
            let leading = *tx.borrow();
            let started = tokio::time::Instant::now();
            // A renewal that has not succeeded by the fencing margin before that expiry
            // counts as failed: the holder must have stopped, with the margin to spare,
            // before a follower can take over.
            let bound = match (leading, held_since) {
                (true, Some(since)) => (since + self.options.lease_duration
                    - self.options.fencing_margin())
                .saturating_duration_since(started)
                .min(self.options.renew_before_expiry),
                _ => self.options.lease_duration,
            };
            let attempt = tokio::select! {
                biased;
                _ = &mut shutdown => return self.release(&tx).await,
                r = tokio::time::timeout(bound, self.api.acquire_or_renew(&mut observed)) => r,
            };
            if !matches!(attempt, Ok(Ok(true))) {
                held_since = None;
            }
            let wait = match attempt {
                Ok(Err(e)) if !reached && is_refusal(&e) => return Err(self.error(e)),
                Ok(Ok(true)) => {
                    reached = true;
                    backoff = FIRST_ERROR_BACKOFF;
                    held_since = Some(started);
                    if publish(&tx, true) {
                        info!(%identity, %lease, "acquired leadership");
                    }
                    // Counted from the attempt's start, so a slow renewal does not push
                    // the next one towards the step-down deadline.
                    self.renew_every.saturating_sub(started.elapsed())
                }
                Ok(Ok(false)) => {
                    reached = true;
                    backoff = FIRST_ERROR_BACKOFF;
                    if publish(&tx, false) {
                        info!(%identity, %lease, "lost leadership: the lease is held by another replica");
                    }
                    self.options.retry_period
                }
                Ok(Err(e)) => {
                    if publish(&tx, false) {
                        warn!(%identity, %lease, error = %e, "lost leadership: the lease could not be renewed");
                    } else {
                        warn!(%identity, %lease, error = %e, "leader election failed; retrying");
                    }
                    next_backoff(&mut backoff, max_backoff)
                }
                Err(_) => {
                    if publish(&tx, false) {
                        warn!(%identity, %lease, timeout = ?bound, "lost leadership: the renewal took too long");
                    }
                    next_backoff(&mut backoff, max_backoff)
                }
            };
            if sleep_or_shutdown(wait, &mut shutdown).await {
                return self.release(&tx).await;
            }
        }
    }

    /// Shutdown: step down first (the caller stops reconciling on `false`), then clear the
    /// lease if it is ours, within the release timeout.
    async fn release(&self, tx: &watch::Sender<bool>) -> Result<(), LeaderError> {
        let identity = self.options.identity.as_str();
        let lease = self.lease.as_str();
        let was_leading = publish(tx, false);
        match tokio::time::timeout(self.options.release_timeout, self.api.release()).await {
            Ok(Ok(())) => {
                if was_leading {
                    info!(%identity, %lease, "released leadership");
                }
                Ok(())
            }
            Ok(Err(e)) => Err(self.error(e)),
            Err(_) => Err(LeaderError::ReleaseTimeout {
                namespace: self.options.namespace.clone(),
                name: self.options.lease_name.clone(),
                timeout: self.options.release_timeout,
            }),
        }
    }
}

/// Publishes `leading`; true if it changed (only changes wake the receivers).
fn publish(tx: &watch::Sender<bool>, leading: bool) -> bool {
    tx.send_if_modified(|v| {
        let changed = *v != leading;
        *v = leading;
        changed
    })
}

fn next_backoff(current: &mut Duration, max: Duration) -> Duration {
    let wait = *current;
    *current = current.saturating_mul(2).min(max);
    wait
}

/// Sleeps for `wait`; true if shutdown was asked for meanwhile.
async fn sleep_or_shutdown(wait: Duration, shutdown: &mut oneshot::Receiver<()>) -> bool {
    tokio::select! {
        biased;
        _ = shutdown => true,
        () = tokio::time::sleep(wait) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::{BTreeMap, BTreeSet};
    use std::future::Future;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use http::{Method, Request, Response, StatusCode, Uri};
    use jiff::{SignedDuration, Timestamp};
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::api::{Api, Patch, PatchParams};
    use kube::client::Body;
    use serde_json::{Map, Value, json};

    use crate::api::proxy::ProxySpec;
    use crate::provider::decorate::Fenced;
    use crate::provider::fake::FakeProvider;
    use crate::provider::{
        BoxFuture, CreateRequest, Fence, Instance, InstanceId, Provider, ProviderError, ProxyRef,
        TargetListing,
    };

    // ---- An in-memory Lease API ----------------------------------------------------------

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
    struct FakeApi {
        state: Mutex<FakeState>,
    }

    #[derive(Default)]
    struct FakeState {
        leases: BTreeMap<(String, String), StoredLease>,
        /// Every change of `holderIdentity`, in order.
        changes: Vec<HolderChange>,
        /// Patches that moved `renewTime` while the holder stayed the same.
        renewals: usize,
        unexpected: Vec<String>,
        /// Answer everything with 503, as an unreachable API server would.
        failing: bool,
        /// Never answer writes that name this holder (a renewal stuck in a slow API server).
        stalled_holder: Option<String>,
        /// Writes that no resourceVersion guarded (patches, updates without a version).
        unguarded: Vec<String>,
        resource_version: u64,
    }

    #[derive(Default)]
    struct StoredLease {
        spec: Map<String, Value>,
        /// Field name to the `manager/Operation` keys that own it.
        owners: BTreeMap<String, BTreeSet<String>>,
        resource_version: u64,
    }

    #[derive(Debug, Clone)]
    struct HolderChange {
        at: Timestamp,
        /// Field manager of the request that made the change.
        by: String,
        before: Option<String>,
        after: Option<String>,
        /// When the lease held before the change expired (renewTime + duration).
        expiry_before: Option<Timestamp>,
    }

    impl StoredLease {
        fn holder(&self) -> Option<String> {
            self.spec
                .get("holderIdentity")
                .and_then(Value::as_str)
                .map(str::to_string)
        }

        fn expiry(&self) -> Option<Timestamp> {
            let renew: Timestamp = self.spec.get("renewTime")?.as_str()?.parse().ok()?;
            let secs = self.spec.get("leaseDurationSeconds")?.as_i64()?;
            renew.checked_add(SignedDuration::from_secs(secs)).ok()
        }

        fn remove(&mut self, field: &str) {
            self.spec.remove(field);
            self.owners.remove(field);
        }

        fn to_json(&self, namespace: &str, name: &str) -> Value {
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
        fn apply(
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
        fn update(&mut self, manager: &str, patch: &Map<String, Value>) {
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

    fn respond(code: StatusCode, body: &Value) -> Response<Body> {
        let mut response = Response::new(Body::from(body.to_string().into_bytes()));
        *response.status_mut() = code;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        response
    }

    fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
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
        async fn serve(&self, request: Request<Body>) -> Response<Body> {
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
                && String::from_utf8_lossy(&body)
                    .contains(&format!("\"holderIdentity\":\"{holder}\""))
            {
                return std::future::pending().await;
            }
            self.state
                .lock()
                .unwrap()
                .handle(&parts.method, &parts.uri, content_type, &body)
        }

        fn stall_writes_of(&self, holder: &str) {
            self.state.lock().unwrap().stalled_holder = Some(holder.to_string());
        }

        fn holder(&self) -> Option<String> {
            let state = self.state.lock().unwrap();
            state.leases.values().next().and_then(StoredLease::holder)
        }

        fn changes(&self) -> Vec<HolderChange> {
            self.state.lock().unwrap().changes.clone()
        }

        fn renewals(&self) -> usize {
            self.state.lock().unwrap().renewals
        }

        fn unexpected(&self) -> Vec<String> {
            self.state.lock().unwrap().unexpected.clone()
        }

        fn set_failing(&self, failing: bool) {
            self.state.lock().unwrap().failing = failing;
        }

        fn unguarded(&self) -> Vec<String> {
            self.state.lock().unwrap().unguarded.clone()
        }
    }

    impl FakeState {
        fn handle(
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
                (&Method::PUT, [ns, "leases", name]) => self.replace(ns, name, &query, body),
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

        fn create(&mut self, ns: &str, body: &[u8]) -> Response<Body> {
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

        fn replace(
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

        fn patch(
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

    fn key(ns: &str, name: &str) -> (String, String) {
        (ns.to_string(), name.to_string())
    }

    fn not_found(name: &str) -> Response<Body> {
        status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("leases \"{name}\" not found"),
        )
    }

    /// A client of `fake`; each has its own connection (mock) but they share the state.
    fn client(fake: &Arc<FakeApi>) -> Client {
        let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let fake = Arc::clone(fake);
        tokio::spawn(async move {
            while let Some((request, reply)) = handle.next_request().await {
                reply.send_response(fake.serve(request).await);
            }
        });
        Client::new(mock, "default")
    }

    // ---- Helpers -------------------------------------------------------------------------

    fn options(identity: &str, duration_secs: u64, renew_before_secs: u64) -> LeaderOptions {
        LeaderOptions {
            lease_duration: Duration::from_secs(duration_secs),
            renew_before_expiry: Duration::from_secs(renew_before_secs),
            retry_period: Duration::from_millis(200),
            release_timeout: Duration::from_secs(5),
            ..LeaderOptions::new("egress-system", identity)
        }
    }

    /// Hang guard: generous, only there so that a broken election fails instead of hanging.
    async fn within<F: Future>(secs: u64, what: &str, future: F) -> F::Output {
        match tokio::time::timeout(Duration::from_secs(secs), future).await {
            Ok(output) => output,
            Err(_) => panic!("timed out after {secs}s waiting for {what}"),
        }
    }

    #[derive(Debug, Default)]
    struct Samples {
        total: usize,
        both: usize,
        first: usize,
        second: usize,
    }

    /// Samples two replicas' view of leadership every few milliseconds until stopped.
    struct Sampler {
        stop: Arc<AtomicBool>,
        task: JoinHandle<Samples>,
    }

    fn sample(first: Leadership, second: Leadership) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut samples = Samples::default();
            while !stopped.load(Ordering::Relaxed) {
                let (a, b) = (first.is_leader(), second.is_leader());
                samples.total += 1;
                samples.first += usize::from(a);
                samples.second += usize::from(b);
                samples.both += usize::from(a && b);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            samples
        });
        Sampler { stop, task }
    }

    impl Sampler {
        /// Stops sampling; fails if both replicas ever claimed to lead at once, or if either
        /// never led (then the sampling proved nothing).
        async fn finish(self) {
            self.stop.store(true, Ordering::Relaxed);
            let samples = self.task.await.unwrap();
            assert_eq!(samples.both, 0, "both replicas led at once: {samples:?}");
            assert!(
                samples.first > 0 && samples.second > 0,
                "each replica should have led: {samples:?}"
            );
        }
    }

    fn manager_of(identity: &str) -> String {
        format!("{FIELD_MANAGER_PREFIX}{identity}")
    }

    /// Every change that took the lease away from a holder was made by that holder itself
    /// (a release) or after its lease had expired.
    fn assert_no_early_takeover(changes: &[HolderChange]) {
        for change in changes {
            let Some(previous) = &change.before else {
                continue;
            };
            if change.after.as_ref() == Some(previous) || change.by == manager_of(previous) {
                continue;
            }
            let expiry = change.expiry_before.unwrap();
            assert!(
                change.at > expiry,
                "{change:?} took the lease from {previous} before it expired; all changes: {changes:?}"
            );
        }
    }

    // ---- Handover ------------------------------------------------------------------------

    #[tokio::test]
    async fn graceful_release_hands_over_before_the_lease_expires() {
        let fake = Arc::new(FakeApi::default());
        // A 30 s lease and 10 s guards: B can only lead in time if A's release works.
        let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 30, 10))
            .await
            .unwrap();
        within(10, "replica-a to lead", a.acquired()).await.unwrap();
        let (mut b, b_elector) = LeaderElector::start(client(&fake), options("replica-b", 30, 10))
            .await
            .unwrap();
        let sampler = sample(a.clone(), b.clone());

        // B re-reads the lease every 200 ms: several chances to take it wrongly.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(a.is_leader());
        assert!(!b.is_leader());
        assert_eq!(fake.holder().as_deref(), Some("replica-a"));

        a_elector.shutdown().await.unwrap();
        assert!(!a.is_leader());
        within(10, "replica-b to take over", b.acquired())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        sampler.finish().await;

        let changes = fake.changes();
        let released = changes
            .iter()
            .find(|c| c.before.as_deref() == Some("replica-a") && c.after.is_none())
            .unwrap_or_else(|| panic!("replica-a never released the lease: {changes:?}"));
        assert_eq!(released.by, manager_of("replica-a"));
        let taken = changes
            .iter()
            .find(|c| c.after.as_deref() == Some("replica-b"))
            .unwrap_or_else(|| panic!("replica-b never took the lease: {changes:?}"));
        assert!(
            taken.at < released.expiry_before.unwrap(),
            "replica-b waited for the released lease to expire: {changes:?}"
        );
        assert_no_early_takeover(&changes);

        b_elector.shutdown().await.unwrap();
        assert!(!b.is_leader());
        assert_eq!(fake.holder(), None);
        assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
    }

    #[tokio::test]
    async fn crashed_leader_is_replaced_only_after_its_lease_expires() {
        let fake = Arc::new(FakeApi::default());
        // Both start at once and race for the free lease.
        let (a, b) = tokio::join!(
            LeaderElector::start(client(&fake), options("replica-a", 3, 1)),
            LeaderElector::start(client(&fake), options("replica-b", 3, 1)),
        );
        let ((a, a_elector), (b, b_elector)) = (a.unwrap(), b.unwrap());
        let a_leads = within(10, "one replica to lead", async {
            loop {
                if a.is_leader() {
                    return true;
                }
                if b.is_leader() {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        let (leader, leader_elector, leader_id, mut follower, follower_elector) = if a_leads {
            (a, a_elector, "replica-a", b, b_elector)
        } else {
            (b, b_elector, "replica-b", a, a_elector)
        };
        let sampler = sample(leader.clone(), follower.clone());

        // The leader renews every 2 s; the follower must not take a renewed lease.
        within(10, "a renewal", async {
            while fake.renewals() == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(leader.is_leader());
        assert!(!follower.is_leader());

        // Dies without releasing.
        leader_elector.abort();
        within(15, "the follower to take over", follower.acquired())
            .await
            .unwrap();
        assert!(!leader.is_leader());
        tokio::time::sleep(Duration::from_millis(200)).await;
        sampler.finish().await;

        let changes = fake.changes();
        let takeover = changes
            .iter()
            .find(|c| c.before.as_deref() == Some(leader_id) && c.by != manager_of(leader_id))
            .unwrap_or_else(|| panic!("nobody took the lease from {leader_id}: {changes:?}"));
        assert!(takeover.at > takeover.expiry_before.unwrap(), "{changes:?}");
        assert_no_early_takeover(&changes);

        follower_elector.shutdown().await.unwrap();
        assert_eq!(fake.holder(), None);
        assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
    }

    #[tokio::test]
    async fn leader_steps_down_when_it_cannot_renew_and_leads_again_after() {
        let fake = Arc::new(FakeApi::default());
        let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 4, 2))
            .await
            .unwrap();
        within(10, "replica-a to lead", a.acquired()).await.unwrap();

        fake.set_failing(true);
        within(10, "replica-a to step down", a.lost()).await;
        assert!(!a.is_leader());
        assert!(!a_elector.is_finished());

        fake.set_failing(false);
        within(15, "replica-a to lead again", a.acquired())
            .await
            .unwrap();
        a_elector.shutdown().await.unwrap();
        assert_eq!(fake.holder(), None);
        assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
    }

    /// A renewal that hangs (the API server never answers) is the worst case for fencing:
    /// the last record a follower times was written right after the holder's last good
    /// renewal began. The holder must step down at least the fencing margin before that
    /// follower can take over, so that a deposed replica has the margin to cut its calls
    /// off. (Bounding each renewal by `renew_before_expiry` from its own start, as before,
    /// stepped down at about the moment the follower took over.)
    #[tokio::test]
    async fn a_hung_renewal_steps_down_the_fencing_margin_before_a_takeover() {
        let fake = Arc::new(FakeApi::default());
        let a_options = options("replica-a", 6, 4);
        let margin = a_options.fencing_margin();
        assert_eq!(margin, Duration::from_secs(2));
        let (mut a, a_elector) = LeaderElector::start(client(&fake), a_options)
            .await
            .unwrap();
        within(10, "replica-a to lead", a.acquired()).await.unwrap();
        let (mut b, b_elector) = LeaderElector::start(client(&fake), options("replica-b", 6, 4))
            .await
            .unwrap();
        // Let A renew once more, then let its renewals hang.
        within(10, "a renewal", async {
            while fake.renewals() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        fake.stall_writes_of("replica-a");
        within(20, "replica-a to step down", a.lost()).await;
        let stepped_down = std::time::Instant::now();
        within(20, "replica-b to take over", b.acquired())
            .await
            .unwrap();
        let gap = stepped_down.elapsed();
        // A lower bound on an interval the protocol fixes, not a time limit: before, the gap
        // was at most a follower's retry period (200 ms here).
        assert!(
            gap >= margin / 2,
            "replica-a stepped down only {gap:?} before replica-b took over (margin {margin:?})"
        );
        assert_no_early_takeover(&fake.changes());
        b_elector.shutdown().await.unwrap();
        a_elector.abort();
    }

    #[tokio::test]
    async fn follower_shutdown_leaves_the_leaders_lease_alone() {
        let fake = Arc::new(FakeApi::default());
        let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 30, 10))
            .await
            .unwrap();
        within(10, "replica-a to lead", a.acquired()).await.unwrap();
        let (mut b, b_elector) = LeaderElector::start(client(&fake), options("replica-b", 30, 10))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        b_elector.shutdown().await.unwrap();
        assert!(matches!(b.acquired().await, Err(LeaderError::Stopped)));
        assert!(a.is_leader());
        assert_eq!(fake.holder().as_deref(), Some("replica-a"));
        a_elector.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn dropping_the_elector_releases_the_lease() {
        let fake = Arc::new(FakeApi::default());
        let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 30, 10))
            .await
            .unwrap();
        within(10, "replica-a to lead", a.acquired()).await.unwrap();
        drop(a_elector);
        within(10, "replica-a to step down", a.lost()).await;
        within(10, "the release", async {
            while fake.holder().is_some() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }

    #[tokio::test]
    async fn start_reports_an_unreachable_api() {
        let fake = Arc::new(FakeApi::default());
        fake.set_failing(true);
        let err = LeaderElector::start(client(&fake), options("replica-a", 4, 2))
            .await
            .unwrap_err();
        assert!(matches!(err, LeaderError::Lease { .. }), "{err}");
        assert_eq!(err.class(), ErrorClass::Transient);
    }

    // ---- Fencing: a deposed replica stops acting ------------------------------------------

    /// One provider call as a replica made it: when it began and when it ended (returned,
    /// or was dropped when cancelled).
    #[derive(Debug, Clone)]
    struct Call {
        replica: &'static str,
        op: &'static str,
        began: std::time::Instant,
        ended: Option<std::time::Instant>,
    }

    /// Both replicas' calls to the shared hosts, in order.
    #[derive(Default)]
    struct Calls(Mutex<Vec<Call>>);

    impl Calls {
        fn all(&self) -> Vec<Call> {
            self.0.lock().unwrap().clone()
        }
    }

    /// Marks the call ended when dropped: on return and on cancellation alike.
    struct Ends<'a> {
        calls: &'a Calls,
        index: usize,
    }

    impl Drop for Ends<'_> {
        fn drop(&mut self) {
            self.calls.0.lock().unwrap()[self.index].ended = Some(std::time::Instant::now());
        }
    }

    /// One replica's view of the shared hosts, each call logged with its replica.
    struct Replica {
        name: &'static str,
        hosts: Arc<FakeProvider>,
        calls: Arc<Calls>,
    }

    impl Replica {
        fn begin(&self, op: &'static str) -> Ends<'_> {
            let mut calls = self.calls.0.lock().unwrap();
            calls.push(Call {
                replica: self.name,
                op,
                began: std::time::Instant::now(),
                ended: None,
            });
            Ends {
                calls: &self.calls,
                index: calls.len() - 1,
            }
        }
    }

    impl Provider for Replica {
        fn name(&self) -> &str {
            self.hosts.name()
        }
        fn create<'a>(
            &'a self,
            req: &'a CreateRequest,
        ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            Box::pin(async move {
                let _end = self.begin("create");
                self.hosts.create(req).await
            })
        }
        fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            Box::pin(async move {
                let _end = self.begin("get");
                self.hosts.get(id).await
            })
        }
        fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
            Box::pin(async move {
                let _end = self.begin("delete");
                self.hosts.delete(id).await
            })
        }
        fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
            Box::pin(async move {
                let _end = self.begin("list");
                self.hosts.list().await
            })
        }
    }

    fn create_request() -> CreateRequest {
        CreateRequest {
            proxy: ProxyRef {
                namespace: "default".into(),
                name: "office".into(),
                uid: "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697801".into(),
            },
            spec: ProxySpec {
                provider: "kvm2".into(),
                ..Default::default()
            },
            user_data: None,
            fence: Fence::unfenced(),
        }
    }

    /// Two replicas drive the same hosts through the fence. Replica A's elector dies (a
    /// stuck or partitioned process: the lease is not released) while A has a Create in
    /// flight on a slow step. A's Create is cancelled within the grace, A starts nothing
    /// more, and B, leading once A's lease expired, makes the only instance; no call of A
    /// overlaps any call of B. Without the fence A's Create would run on for 30 s, well
    /// into B's term, and define the same domain B does.
    #[tokio::test]
    async fn a_deposed_replica_stops_acting_before_the_new_leader_starts() {
        let fake = Arc::new(FakeApi::default());
        let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 3, 1))
            .await
            .unwrap();
        within(10, "replica-a to lead", a.acquired()).await.unwrap();
        let (mut b, b_elector) = LeaderElector::start(client(&fake), options("replica-b", 3, 1))
            .await
            .unwrap();
        let sampler = sample(a.clone(), b.clone());

        let hosts = Arc::new(FakeProvider::named("kvm2", &["h1"]));
        let calls = Arc::new(Calls::default());
        let grace = Duration::from_millis(300);
        let via = |name, leadership: &Leadership| {
            Arc::new(Fenced::new(
                Arc::new(Replica {
                    name,
                    hosts: hosts.clone(),
                    calls: calls.clone(),
                }),
                leadership.fence(),
                grace,
            ))
        };
        let (via_a, via_b) = (via("a", &a), via("b", &b));

        // A's Create waits on a slow step (an image download).
        hosts.set_create_delay(Duration::from_secs(30));
        let in_flight = tokio::spawn({
            let via_a = via_a.clone();
            async move { via_a.create(&create_request()).await }
        });
        within(10, "A's Create to reach the hosts", async {
            while hosts.calls().is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;

        a_elector.abort();
        let err = within(5, "A's Create to be cancelled", in_flight)
            .await
            .unwrap()
            .expect_err("A's Create must not finish");
        assert!(err.is_lease_lost(), "{err}");
        assert_eq!(err.class(), ErrorClass::Transient);
        assert!(hosts.instances().is_empty(), "A defined nothing");

        // A starts nothing more: every call is refused before it reaches the hosts.
        let reached = hosts.calls().len();
        let id = InstanceId {
            host: "h1".into(),
            name: "egress-x".into(),
        };
        assert!(
            via_a
                .create(&create_request())
                .await
                .unwrap_err()
                .is_lease_lost()
        );
        assert!(via_a.get(&id).await.unwrap_err().is_lease_lost());
        assert!(via_a.delete(&id).await.unwrap_err().is_lease_lost());
        let listing = via_a.list().await;
        assert!(
            listing.len() == 1 && listing[0].result.as_ref().is_err_and(|e| e.is_lease_lost()),
            "{listing:?}"
        );
        assert_eq!(
            hosts.calls().len(),
            reached,
            "A reached the hosts after losing"
        );

        // B leads once A's lease expired, and makes the one instance.
        within(15, "replica-b to take over", b.acquired())
            .await
            .unwrap();
        hosts.set_create_delay(Duration::ZERO);
        let made = via_b.create(&create_request()).await.unwrap();
        assert_eq!(hosts.instances(), vec![made]);

        let all = calls.all();
        let a_ended = all
            .iter()
            .filter(|c| c.replica == "a")
            .map(|c| c.ended.expect("an A call never ended"))
            .max()
            .unwrap();
        let b_began = all
            .iter()
            .filter(|c| c.replica == "b")
            .map(|c| c.began)
            .min()
            .unwrap();
        assert!(a_ended < b_began, "A and B acted at once: {all:?}");
        assert_eq!(
            all.iter().map(|c| (c.replica, c.op)).collect::<Vec<_>>(),
            vec![("a", "create"), ("b", "create")]
        );

        tokio::time::sleep(Duration::from_millis(200)).await;
        sampler.finish().await;
        b_elector.shutdown().await.unwrap();
        assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
    }

    // ---- Every write is guarded ------------------------------------------------------------

    /// Two followers read the same expired lease; one takes it; the other's write, based on
    /// its stale read, must fail instead of wiping (or overwriting) the new hold.
    /// `kube-lease-manager` released an expired lease with an unconditional patch, so the
    /// slower follower cleared the faster one's fresh hold and both led.
    #[tokio::test]
    async fn a_write_based_on_a_stale_read_cannot_take_or_wipe_a_fresh_hold() {
        let fake = Arc::new(FakeApi::default());
        // An expired hold by a crashed replica.
        {
            let mut state = fake.state.lock().unwrap();
            state.resource_version = 7;
            let mut spec = Map::new();
            spec.insert("holderIdentity".into(), json!("crashed"));
            spec.insert("leaseDurationSeconds".into(), json!(1));
            spec.insert("renewTime".into(), json!("2020-01-01T00:00:00.000000Z"));
            state.leases.insert(
                key("egress-system", DEFAULT_LEASE_NAME),
                StoredLease {
                    spec,
                    owners: BTreeMap::new(),
                    resource_version: 7,
                },
            );
        }
        let a = LeaseApi::new(client(&fake), &options("replica-a", 3, 1), 3);
        let b = LeaseApi::new(client(&fake), &options("replica-b", 3, 1), 3);
        let (mut seen_a, mut seen_b) = (Observed::default(), Observed::default());
        let read_a = a.read_or_create().await.unwrap();
        let read_b = b.read_or_create().await.unwrap();
        seen_a.saw(&read_a);
        seen_b.saw(&read_b);
        // Both have watched the crashed hold, unchanged, for longer than its duration.
        tokio::time::sleep(Duration::from_millis(1100)).await;

        assert!(a.take(&read_a, &mut seen_a).await.unwrap(), "a takes it");
        assert!(
            !b.take(&read_b, &mut seen_b).await.unwrap(),
            "b's write was based on the version before a's"
        );
        assert_eq!(fake.holder().as_deref(), Some("replica-a"));
        // b re-reads: a fresh hold, so b follows.
        assert!(!b.acquire_or_renew(&mut seen_b).await.unwrap());
        assert_eq!(fake.holder().as_deref(), Some("replica-a"));
        assert!(a.acquire_or_renew(&mut seen_a).await.unwrap(), "a renews");
        let changes = fake.changes();
        assert_eq!(changes.len(), 1, "one change of holder: {changes:?}");
        assert!(fake.unguarded().is_empty(), "{:?}", fake.unguarded());
    }

    /// Three replicas, the holder killed and restarted over and over: at most one leads at
    /// any sample, and no write of any replica is unguarded.
    #[tokio::test]
    async fn three_replicas_never_lead_together_and_every_write_is_guarded() {
        let fake = Arc::new(FakeApi::default());
        let mut replicas = Vec::new();
        for id in ["replica-a", "replica-b", "replica-c"] {
            let (l, e) = LeaderElector::start(client(&fake), options(id, 2, 1))
                .await
                .unwrap();
            replicas.push((id.to_string(), l, Some(e)));
        }
        let views: Arc<Mutex<Vec<Leadership>>> =
            Arc::new(Mutex::new(replicas.iter().map(|r| r.1.clone()).collect()));
        let sampled = Arc::clone(&views);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let sampler = tokio::spawn(async move {
            let mut both = 0;
            while !stopped.load(Ordering::Relaxed) {
                if sampled
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|v| v.is_leader())
                    .count()
                    > 1
                {
                    both += 1;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            both
        });
        for round in 0..3 {
            let leader = within(15, "a leader", async {
                loop {
                    if let Some(i) = replicas.iter().position(|r| r.1.is_leader()) {
                        return i;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
            // Killed without a release: the others must wait out the lease. It comes back
            // as a new pod (a new identity).
            if let Some(e) = replicas[leader].2.take() {
                e.abort();
            }
            let id = format!("{}-{round}", replicas[leader].0);
            let (l, e) = LeaderElector::start(client(&fake), options(&id, 2, 1))
                .await
                .unwrap();
            views.lock().unwrap()[leader] = l.clone();
            replicas[leader] = (id, l, Some(e));
        }
        stop.store(true, Ordering::Relaxed);
        assert_eq!(sampler.await.unwrap(), 0, "two replicas led at once");
        assert_no_early_takeover(&fake.changes());
        for (_, _, e) in replicas {
            if let Some(e) = e {
                e.shutdown().await.unwrap();
            }
        }
        assert!(fake.unguarded().is_empty(), "{:?}", fake.unguarded());
        assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
    }

    // ---- The fake itself -----------------------------------------------------------------

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

    // ---- Options, identity, classes ------------------------------------------------------

    #[test]
    fn defaults_are_valid_and_bad_timings_are_refused() {
        let good = LeaderOptions::new("ns", "pod-a");
        good.validate().unwrap();
        assert_eq!(good.lease_name, DEFAULT_LEASE_NAME);

        let bad: [fn(&mut LeaderOptions); 8] = [
            |o| o.renew_before_expiry = o.lease_duration,
            |o| o.renew_before_expiry = Duration::ZERO,
            |o| o.lease_duration = Duration::from_secs(1),
            |o| o.lease_duration = Duration::from_millis(15_500),
            |o| o.retry_period = Duration::ZERO,
            |o| o.retry_period = o.lease_duration,
            |o| o.identity = " ".to_string(),
            |o| o.namespace = String::new(),
        ];
        for (i, spoil) in bad.iter().enumerate() {
            let mut options = good.clone();
            spoil(&mut options);
            let err = options.validate().unwrap_err();
            assert!(
                matches!(err, LeaderError::InvalidOptions(_)),
                "case {i}: {err}"
            );
            assert_eq!(err.class(), ErrorClass::Permanent, "case {i}");
        }
    }

    #[tokio::test]
    async fn start_refuses_bad_options_without_calling_the_api() {
        let fake = Arc::new(FakeApi::default());
        let mut options = options("replica-a", 4, 2);
        options.renew_before_expiry = Duration::from_secs(4);
        let err = LeaderElector::start(client(&fake), options)
            .await
            .unwrap_err();
        assert!(matches!(err, LeaderError::InvalidOptions(_)), "{err}");
        assert!(fake.state.lock().unwrap().leases.is_empty());
    }

    #[test]
    fn identity_is_the_pod_name_else_the_host_name() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(identity_from(s("pod-a"), s("host")).unwrap(), "pod-a");
        assert_eq!(identity_from(s(" "), s("host\n")).unwrap(), "host");
        assert_eq!(identity_from(None, s("host")).unwrap(), "host");
        assert!(matches!(
            identity_from(None, s("")),
            Err(LeaderError::NoIdentity)
        ));
        assert!(matches!(
            identity_from(None, None),
            Err(LeaderError::NoIdentity)
        ));
    }

    #[test]
    fn api_failures_are_classified_by_status_code() {
        let api = |code: u16| {
            LeaderError::Lease {
                namespace: "ns".into(),
                name: "l".into(),
                source: kube::Error::Api(
                    kube::core::Status::failure("x", "y")
                        .with_code(code)
                        .boxed(),
                ),
            }
            .class()
        };
        assert_eq!(api(403), ErrorClass::Permanent);
        assert_eq!(api(404), ErrorClass::NotFound);
        assert_eq!(api(409), ErrorClass::Transient);
        assert_eq!(api(429), ErrorClass::Transient);
        assert_eq!(api(503), ErrorClass::Transient);
    }
}
