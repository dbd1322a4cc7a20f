//! Providers: the code that creates, finds and deletes proxy VMs somewhere.
//!
//! The controller sees a provider only through [`Provider`], so nothing here knows about
//! Kubernetes and the controller knows nothing about libvirt. Every error a provider
//! returns carries an [`ErrorClass`]; that class, not the message, decides whether the
//! controller retries soon (transient), slowly (quota), not at all (permanent), or treats
//! the instance as gone (not found).
//!
//! - [`kvm2`]: libvirt hosts reached over SSH, the one real provider.
//! - [`registry`]: builds the configured providers by name.
//! - [`decorate`]: metrics and tracing around any provider.
//! - [`fake`]: an in-memory provider for tests of code that uses providers.

pub mod decorate;
pub mod fake;
pub mod health;
pub mod kvm2;
pub mod registry;

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::api::proxy::ProxySpec;
use crate::error::{Classified, ErrorClass};

/// Which Proxy an instance belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProxyRef {
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name; becomes the guest's host name.
    pub name: String,
    /// Proxy UID: every name of the instance is derived from it.
    pub uid: String,
}

/// cloud-init user-data: a secret. Its `Debug` shows only the length, and it has no
/// `Display`, so it cannot end up in a log line or an error by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct UserData(Vec<u8>);

impl UserData {
    /// Wraps the bytes read from the Proxy's Secret.
    pub fn new(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }

    /// The bytes, for the seed ISO only.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for UserData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UserData({} bytes, redacted)", self.0.len())
    }
}

/// What the controller asks a provider to create.
#[derive(Debug, Clone)]
pub struct CreateRequest {
    /// The owning Proxy.
    pub proxy: ProxyRef,
    /// The Proxy's spec (machine type, image, placement), already validated.
    pub spec: ProxySpec,
    /// cloud-init user-data from the Proxy's Secret, if it names one.
    pub user_data: Option<UserData>,
    /// Whether this replica may still act for the Proxy; checked right before the steps
    /// two replicas must not both take (define, start). [`Fence::unfenced`] where only one
    /// process can act (the CLI, tests); the [`decorate::Fenced`] decorator sets the
    /// leader's fence on every Create that passes through it.
    pub fence: Fence,
}

/// A cheap handle on "this replica still holds the leader lease".
///
/// A replica that loses the lease can have a Create in flight while the new leader starts
/// its own Create of the same domain; if both define and start, the loser's failure cleanup
/// can destroy the winner's VM. So a provider checks the fence right before define and
/// right before start, and a Create that finds it lost fails with [`LeaseLost`] (transient)
/// and removes what it made. The new leader cannot act before the old lease expires, which
/// is seconds after the holder noticed the loss: a check that passed is still good for the
/// one libvirt call that follows it.
#[derive(Clone, Debug, Default)]
pub struct Fence {
    /// `true` while the lease is held; `None` for a fence that is always held.
    rx: Option<watch::Receiver<bool>>,
}

impl Fence {
    /// Always held: for the one process that may act (`provision`, a single replica run
    /// without leader election, tests).
    pub fn unfenced() -> Self {
        Self { rx: None }
    }

    /// Held while `rx` reads `true` and its sender lives (an elector that was aborted
    /// cannot publish `false`, so a dropped sender counts as lost).
    pub fn new(rx: watch::Receiver<bool>) -> Self {
        Self { rx: Some(rx) }
    }

    /// Whether the lease is held now.
    pub fn is_held(&self) -> bool {
        match &self.rx {
            None => true,
            Some(rx) => *rx.borrow() && rx.has_changed().is_ok(),
        }
    }

    /// `Ok` while held; else the typed refusal naming the step that was not started.
    pub fn check(&self, step: &'static str) -> Result<(), LeaseLost> {
        if self.is_held() {
            Ok(())
        } else {
            Err(LeaseLost::Refused { step })
        }
    }

    /// Resolves once the lease is no longer held (at once if it is not); never for an
    /// unfenced handle.
    pub async fn lost(&self) {
        let Some(rx) = &self.rx else {
            return std::future::pending().await;
        };
        let mut rx = rx.clone();
        // Err: the sender is gone, which counts as lost.
        let _ = rx.wait_for(|held| !*held).await;
    }
}

/// This replica lost the leader lease, so a provider step was refused or cancelled. Always
/// transient: the new leader carries on, and this replica retries only if it leads again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseLost {
    /// Found lost before the step started; the step was not started.
    #[error("this replica no longer holds the leader lease, so it did not start {step}")]
    Refused {
        /// The step that was not started (`domain define`, `create`, ...).
        step: &'static str,
    },
    /// Lost while the call was in flight; the call was dropped after the grace period.
    #[error(
        "this replica lost the leader lease during {op}; the call was cancelled after a \
         {grace:?} grace period"
    )]
    Cancelled {
        /// The provider operation.
        op: &'static str,
        /// How long it was allowed to go on after the loss.
        grace: Duration,
    },
}

impl Classified for LeaseLost {
    fn class(&self) -> ErrorClass {
        ErrorClass::Transient
    }
}

/// Where an instance lives: enough to find it again without listing.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId {
    /// Host (target) name within the provider.
    pub host: String,
    /// Name of the VM on that host.
    pub name: String,
}

impl InstanceId {
    /// Parses the `host/name` form written to status.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((host, name)) if !host.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self {
                    host: host.into(),
                    name: name.into(),
                })
            }
            _ => Err(format!(
                "instance ID {s:?} is not of the form HOST/NAME (as written to status)"
            )),
        }
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.host, self.name)
    }
}

/// The run state of an instance, as the controller needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InstanceState {
    /// Running.
    Running,
    /// Paused by an administrator or by libvirt (e.g. I/O error).
    Paused,
    /// Defined but not running.
    ShutOff,
    /// Being shut down.
    Dying,
    /// The guest crashed.
    Crashed,
    /// Suspended by guest power management.
    Suspended,
    /// Blocked on a resource.
    Blocked,
    /// The hypervisor reports no state.
    NoState,
}

impl InstanceState {
    /// Stable lower-case label for status and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Running => "running",
            InstanceState::Paused => "paused",
            InstanceState::ShutOff => "shutoff",
            InstanceState::Dying => "dying",
            InstanceState::Crashed => "crashed",
            InstanceState::Suspended => "suspended",
            InstanceState::Blocked => "blocked",
            InstanceState::NoState => "nostate",
        }
    }

    /// Whether the controller should replace an instance in this state: it will not come
    /// back by itself.
    pub fn is_failed(self) -> bool {
        matches!(self, InstanceState::Crashed | InstanceState::ShutOff)
    }
}

impl fmt::Display for InstanceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An instance as a provider reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Where it lives.
    pub id: InstanceId,
    /// The Proxy that owns it, from the ownership mark.
    pub proxy: ProxyRef,
    /// Run state.
    pub state: InstanceState,
    /// Guest addresses, best first (IPv4 before IPv6); empty when not running or unknown.
    pub addresses: Vec<IpAddr>,
    /// Which source answered for `addresses`; `None` when they are empty. Published in
    /// status so a consumer (and an operator debugging a fleet) can judge how fresh and
    /// how authoritative the address is.
    pub address_source: Option<AddressOrigin>,
    /// Whether the guest applied its cloud-init seed: `Some(false)` when the guest agent
    /// answers with a host name other than the seed's `local-hostname` (the guest never
    /// read its seed, e.g. a kernel that cannot see the seed's disk), `Some(true)` when it
    /// matches, `None` when nobody can tell (no agent). A guest that never read its seed
    /// runs but was never configured as a proxy.
    pub seed_applied: Option<bool>,
    /// When it was created (RFC 3339), from the ownership mark.
    pub created_at: String,
}

/// Where a published guest address came from, most authoritative first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressOrigin {
    /// Allocated by the operator from the host's address pool and written into the seed's
    /// network-config: known without asking the guest.
    Static,
    /// The DHCP lease of a libvirt-managed network.
    Lease,
    /// The QEMU guest agent inside the VM.
    Agent,
    /// The host's neighbour (ARP) table.
    Arp,
}

impl AddressOrigin {
    /// Stable lower-case label for status, logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            AddressOrigin::Static => "static",
            AddressOrigin::Lease => "lease",
            AddressOrigin::Agent => "agent",
            AddressOrigin::Arp => "arp",
        }
    }
}

impl fmt::Display for AddressOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A provider failure: a class the controller acts on, and the typed error underneath.
#[derive(Debug)]
pub struct ProviderError {
    class: ErrorClass,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl ProviderError {
    /// Wraps a classified error, keeping its class.
    pub fn new<E>(e: E) -> Self
    where
        E: Classified + std::error::Error + Send + Sync + 'static,
    {
        Self {
            class: e.class(),
            source: Box::new(e),
        }
    }

    /// A plain message with an explicit class (fakes and glue code).
    pub fn msg(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            class,
            source: message.into().into(),
        }
    }

    /// The typed error underneath, for callers that look deeper.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.source.as_ref()
    }

    /// Whether this is a "not found".
    pub fn is_not_found(&self) -> bool {
        self.class == ErrorClass::NotFound
    }

    /// Whether the call failed because this replica lost the leader lease (the error
    /// itself or anywhere in its source chain), so nothing about the instance was learnt
    /// and nothing should be reported for it.
    pub fn is_lease_lost(&self) -> bool {
        self.lease_lost().is_some()
    }

    /// The [`LeaseLost`] this error is or wraps, if any.
    pub fn lease_lost(&self) -> Option<&LeaseLost> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self.inner());
        while let Some(e) = next {
            if let Some(lost) = e.downcast_ref::<LeaseLost>() {
                return Some(lost);
            }
            next = e.source();
        }
        None
    }
}

impl fmt::Display for ProviderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl std::error::Error for ProviderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

impl Classified for ProviderError {
    fn class(&self) -> ErrorClass {
        self.class
    }
}

/// One target's share of a listing: a target whose listing failed says so, and is never
/// reported as empty (the garbage collector must not read "failed" as "nothing there").
#[derive(Debug)]
pub struct TargetListing {
    /// Target (host) name.
    pub target: String,
    /// Instances with our mark for this cluster, or why the listing failed.
    pub result: Result<Vec<Instance>, ProviderError>,
}

/// The health of one target of a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetHealth {
    /// Target (host) name.
    pub target: String,
    /// Whether it answered and looks usable.
    pub reachable: bool,
    /// A short reason code when not (`connect`, `host-key`, `pool-missing`, ...).
    pub reason: Option<String>,
    /// The stage of the dial that failed (`dns`, `tcp-connect`, `ssh-handshake`,
    /// `ssh-auth`, `channel`, `libvirt-open`), when the failure was a dial's.
    pub stage: Option<String>,
    /// Human-readable detail.
    pub message: String,
    /// How long the check took.
    pub latency: std::time::Duration,
}

/// A boxed future, so [`Provider`] can be used as a trait object.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Optional capability: checking the provider's targets (hosts).
pub trait HealthCheck: Send + Sync {
    /// Checks every target, each within `timeout`.
    fn check(&self, timeout: std::time::Duration) -> BoxFuture<'_, Vec<TargetHealth>>;
}

/// What the controller and the garbage collector need from a provider.
///
/// Every method is idempotent: a Create for a Proxy that already has an instance adopts
/// it, a Delete of an instance that is gone succeeds.
pub trait Provider: Send + Sync {
    /// Provider name from the config (`kvm2`).
    fn name(&self) -> &str;

    /// Creates (or adopts) the instance of `req.proxy`, waits until it runs, and reports it.
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>>;

    /// The instance with this ID; a class-`NotFound` error when it does not exist.
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>>;

    /// Deletes the instance and everything made for it; succeeds when it is already gone.
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>>;

    /// Every instance carrying our mark for this cluster, per target.
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>>;

    /// The instances of the Proxy with UID `owner`, per target: what [`Provider::list`]
    /// lists of it. A Delete looks for instances its status does not name (a Create that
    /// finished after a crash); a provider that can find them without listing every
    /// instance overrides this, so a Delete's cost does not grow with the fleet.
    fn instances_of<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<TargetListing>> {
        Box::pin(async move {
            let mut listings = self.list().await;
            for t in &mut listings {
                if let Ok(found) = &mut t.result {
                    found.retain(|i| i.proxy.uid == owner);
                }
            }
            listings
        })
    }

    /// The health-check capability, when the provider has one.
    fn health(&self) -> Option<&dyn HealthCheck> {
        None
    }

    /// [`Provider::get`] for the Proxy with UID `owner`: an instance whose mark names
    /// another Proxy is refused with [`NotOwned`] (permanent), so a status naming someone
    /// else's instance (a restored or hand-edited status) never adopts it.
    fn get_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            let instance = self.get(id).await?;
            NotOwned::check(id, owner, &instance.proxy.uid)?;
            Ok(instance)
        })
    }

    /// [`Provider::delete`] for the Proxy with UID `owner`: reads the instance first and
    /// touches nothing when its mark names another Proxy ([`NotOwned`]) or cannot be read.
    /// An instance that is already gone has no mark to check; its delete removes what the
    /// ID alone names.
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            match self.get_owned(id, owner).await {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e),
            }
            self.delete(id).await
        })
    }

    /// Cuts this provider off its targets, for a replica that lost the leader lease once
    /// the calls it had in flight were cancelled: a call blocked on a target's answer
    /// returns at once, a request still queued in this process never reaches the target,
    /// and nothing reaches a target again until [`Provider::reconnect`]. Waits at most
    /// `bound` for the blocking calls to return. A request a target already received
    /// cannot be recalled (libvirt has no cancellation); it runs there as it would have.
    /// Default: nothing to cut, for providers that hold no connection.
    fn sever(&self, _bound: Duration) -> BoxFuture<'_, Severed> {
        Box::pin(std::future::ready(Severed::default()))
    }

    /// Lifts [`Provider::sever`]: this replica leads again.
    fn reconnect(&self) {}

    /// The revision a Create of `spec` on `host` (`None`: before placement) makes now (what the instance would be
    /// made from), so the controller can record it and tell a running instance made from
    /// older inputs. `None` when this provider keeps no revisions, or cannot tell yet (a
    /// plugin still loading); `Some(Err)` names what the config cannot make.
    fn revision(
        &self,
        _spec: &ProxySpec,
        _host: Option<&str>,
        _user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        None
    }
}

/// What [`Provider::sever`] found: blocking calls (threads waiting on a target) running
/// when it cut the provider off, and those still running when it stopped waiting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Severed {
    /// Blocking calls running at the cut.
    pub at_cut: usize,
    /// Blocking calls still running after the wait: threads the cut did not release.
    pub still_running: usize,
}

/// An instance's mark names another Proxy than the one asking for it. Permanent: nothing
/// was touched, and asking again gives the same answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "instance {instance} belongs to the Proxy with UID {marked}, not to {owner}; left untouched"
)]
pub struct NotOwned {
    /// The instance.
    pub instance: InstanceId,
    /// The UID of the Proxy that asked.
    pub owner: String,
    /// The UID the instance's mark names.
    pub marked: String,
}

impl NotOwned {
    /// `Err` unless `marked` is `owner`.
    pub fn check(id: &InstanceId, owner: &str, marked: &str) -> Result<(), ProviderError> {
        if owner == marked {
            Ok(())
        } else {
            Err(ProviderError::new(NotOwned {
                instance: id.clone(),
                owner: owner.into(),
                marked: marked.into(),
            }))
        }
    }
}

impl Classified for NotOwned {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// A shared provider.
pub type SharedProvider = Arc<dyn Provider>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_ids_round_trip() {
        let id = InstanceId::parse("kvm-a/egress-x").unwrap();
        assert_eq!(id.host, "kvm-a");
        assert_eq!(id.to_string(), "kvm-a/egress-x");
        for bad in ["", "kvm-a", "/x", "kvm-a/", "a/b/c"] {
            assert!(InstanceId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn user_data_never_shows_its_content() {
        let u = UserData::new(b"password: hunter2".to_vec());
        let shown = format!("{u:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("17 bytes"), "{shown}");
    }
}
