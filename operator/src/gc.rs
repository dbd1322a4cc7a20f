//! The garbage collector: deletes instances that no Proxy owns any more, and duplicates a
//! Proxy no longer names.
//!
//! A sweep lists every provider's instances, then which Proxies exist ([`ProxyIndex`]),
//! and deletes an instance when
//! - no Proxy has its UID (`no-proxy`), or
//! - its Proxy's `status.instanceId` names a *different* instance (`duplicate`: left by a
//!   replace, or by a placement while a host was unreachable),
//!
//! and, in both cases, it is older than the grace period. Design invariant 6 holds like
//! this:
//! - *Only our mark*: [`Provider::list`](crate::provider::Provider::list) returns, by contract, only instances carrying our
//!   managed mark for this cluster; a domain without it never reaches the collector. That
//!   is a provider property and is tested there (kvm2's listing tests), not faked here.
//!   The collector still ignores any instance with an empty owner UID.
//! - *Never on a failed listing*: a target whose listing failed is skipped for the round,
//!   never read as empty; if the Proxies cannot be listed, nothing is deleted at all
//!   (an empty owner set would make everything look orphaned).
//! - *Grace period*: age comes from the instance's `created_at`; one that cannot be dated
//!   is kept (and logged), so a Create in flight is never collected.
//!
//! The instance a Proxy's status names is never touched, and nothing of a Proxy whose
//! status names no instance yet is touched either: its Create may be about to write it.
//! A Proxy being deleted is treated like any other: its finalizer deletes the named
//! instance, and its duplicates are collected by the same rule.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::api::proxy::Proxy;
use crate::config::{GcConfig, RetiredImagesPolicy};
use crate::error::{Classified, ErrorClass};
use crate::provider::{BoxFuture, Instance, InstanceId, ProviderError, SharedProvider};

/// What the collector needs to know about one existing Proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name.
    pub name: String,
    /// The instance its status names; `None` when none is named yet (or the value does
    /// not parse), which protects all of its instances.
    pub instance_id: Option<InstanceId>,
    /// Whether the Proxy has a deletion timestamp (for logs; it does not change the rules).
    pub deleting: bool,
    /// Whether the Proxy's phase is `Provisioning`: the controller marks it so before a
    /// Create (and keeps it through transient failures), so a Create of a replacement may
    /// be in flight and own an instance its status does not name yet.
    pub provisioning: bool,
}

/// Which Proxies exist, keyed by UID. A trait so sweeps are tested without a cluster.
pub trait ProxyIndex: Send + Sync {
    /// Every Proxy in the cluster by UID. An error means "unknown", never "none".
    fn owners(&self) -> BoxFuture<'_, Result<HashMap<String, Owner>, GcError>>;

    /// A fresh read of the one Proxy an instance's mark names (`namespace`/`name`),
    /// `None` when it is gone or is now another object (another UID). The collector asks
    /// right before each delete, so a status written since the listing is seen.
    fn owner<'a>(
        &'a self,
        uid: &'a str,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Owner>, GcError>>;
}

/// A collector failure.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// The Proxies could not be listed; the sweep deletes nothing.
    #[error("listing Proxies failed: {source}")]
    ListProxies {
        /// Class of the failure.
        class: ErrorClass,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Deleting a group of leftover volumes failed; the sweep goes on with the next.
    #[error("deleting volumes {key:?} on {target:?} of provider {provider:?} failed: {source}")]
    DeleteVolumes {
        /// Provider name.
        provider: String,
        /// Target (host).
        target: String,
        /// The candidate's key.
        key: String,
        /// What the provider said.
        #[source]
        source: ProviderError,
    },
    /// A delete failed; the sweep goes on with the next instance.
    #[error("deleting instance {instance} of provider {provider:?} failed: {source}")]
    Delete {
        /// Provider name.
        provider: String,
        /// The instance.
        instance: InstanceId,
        /// What the provider said.
        #[source]
        source: ProviderError,
    },
}

impl Classified for GcError {
    fn class(&self) -> ErrorClass {
        match self {
            GcError::ListProxies { class, .. } => *class,
            GcError::Delete { source, .. } | GcError::DeleteVolumes { source, .. } => {
                source.class()
            }
        }
    }
}

/// Page size of the Proxy listing: bounds one response on a big cluster.
const LIST_PAGE: u32 = 500;

/// [`ProxyIndex`] over the Kubernetes API: lists every Proxy in every namespace.
///
/// A plain list (no resource version) is a consistent read, so a Proxy that existed when
/// the instances were listed is in it; a reflector cache could lag behind.
#[derive(Clone)]
pub struct KubeProxyIndex {
    api: kube::Api<Proxy>,
    client: kube::Client,
}

impl std::fmt::Debug for KubeProxyIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeProxyIndex").finish_non_exhaustive()
    }
}

impl KubeProxyIndex {
    /// An index over all namespaces.
    pub fn new(client: kube::Client) -> Self {
        Self {
            api: kube::Api::all(client.clone()),
            client,
        }
    }
}

impl ProxyIndex for KubeProxyIndex {
    fn owners(&self) -> BoxFuture<'_, Result<HashMap<String, Owner>, GcError>> {
        Box::pin(async move {
            let mut owners = HashMap::new();
            let mut params = kube::api::ListParams::default().limit(LIST_PAGE);
            loop {
                let page = self
                    .api
                    .list(&params)
                    .await
                    .map_err(|e| GcError::ListProxies {
                        class: crate::error::kube_error_class(&e),
                        source: Box::new(e),
                    })?;
                owners.extend(page.items.iter().filter_map(owner_of));
                match page.metadata.continue_ {
                    Some(token) if !token.is_empty() => {
                        params = kube::api::ListParams::default()
                            .limit(LIST_PAGE)
                            .continue_token(&token);
                    }
                    _ => break,
                }
            }
            Ok(owners)
        })
    }

    fn owner<'a>(
        &'a self,
        uid: &'a str,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Owner>, GcError>> {
        Box::pin(async move {
            let api: kube::Api<Proxy> = kube::Api::namespaced(self.client.clone(), namespace);
            let found = api.get_opt(name).await.map_err(|e| GcError::ListProxies {
                class: crate::error::kube_error_class(&e),
                source: Box::new(e),
            })?;
            Ok(found
                .as_ref()
                .and_then(owner_of)
                .filter(|(u, _)| u == uid)
                .map(|(_, o)| o))
        })
    }
}

/// The owner entry of a listed Proxy; `None` for an object without a UID (never the case
/// for an object read from the API server, but it could not be keyed).
fn owner_of(p: &Proxy) -> Option<(String, Owner)> {
    let uid = p.metadata.uid.clone().filter(|u| !u.is_empty())?;
    let namespace = p.metadata.namespace.clone().unwrap_or_default();
    let name = p.metadata.name.clone().unwrap_or_default();
    let named = p.status.as_ref().and_then(|s| s.instance_id.as_deref());
    let instance_id = match named.map(InstanceId::parse) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(e)) => {
            tracing::warn!(namespace, name, error = %e, "Proxy status has an unreadable instance ID; none of its instances will be collected");
            None
        }
    };
    Some((
        uid,
        Owner {
            namespace,
            name,
            instance_id,
            deleting: p.metadata.deletion_timestamp.is_some(),
            provisioning: p.status.as_ref().and_then(|s| s.phase)
                == Some(crate::api::proxy::ProxyPhase::Provisioning),
        },
    ))
}

#[derive(Debug, Default)]
struct FakeIndexState {
    owners: HashMap<String, Owner>,
    /// What listings return instead of `owners`, once frozen.
    frozen: Option<HashMap<String, Owner>>,
    fail_next: Option<ErrorClass>,
    fail_rereads: Option<ErrorClass>,
    calls: usize,
    rereads: usize,
}

/// An in-memory [`ProxyIndex`] for tests.
#[derive(Debug, Default)]
pub struct FakeProxyIndex {
    state: Mutex<FakeIndexState>,
}

impl FakeProxyIndex {
    /// An index with no Proxies.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeIndexState> {
        match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        }
    }

    /// Adds (or replaces) the Proxy with this UID.
    pub fn insert(&self, uid: &str, owner: Owner) {
        self.state().owners.insert(uid.into(), owner);
    }

    /// Removes the Proxy with this UID.
    pub fn remove(&self, uid: &str) {
        self.state().owners.remove(uid);
    }

    /// Makes the next listing fail with `class`.
    pub fn fail_next(&self, class: ErrorClass) {
        self.state().fail_next = Some(class);
    }

    /// How many listings were asked for.
    pub fn calls(&self) -> usize {
        self.state().calls
    }

    /// From now on listings return the Proxies as they are now, while single reads
    /// ([`ProxyIndex::owner`]) see later changes: models a listing taken just before a
    /// status write.
    pub fn freeze_listing(&self) {
        let mut s = self.state();
        s.frozen = Some(s.owners.clone());
    }

    /// Makes every single read fail with `class`.
    pub fn fail_rereads(&self, class: ErrorClass) {
        self.state().fail_rereads = Some(class);
    }

    /// How many single reads were asked for.
    pub fn rereads(&self) -> usize {
        self.state().rereads
    }
}

impl ProxyIndex for FakeProxyIndex {
    fn owners(&self) -> BoxFuture<'_, Result<HashMap<String, Owner>, GcError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls += 1;
            match s.fail_next.take() {
                Some(class) => Err(GcError::ListProxies {
                    class,
                    source: "injected Proxy listing failure".into(),
                }),
                None => Ok(s.frozen.clone().unwrap_or_else(|| s.owners.clone())),
            }
        })
    }

    fn owner<'a>(
        &'a self,
        uid: &'a str,
        _namespace: &'a str,
        _name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Owner>, GcError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.rereads += 1;
            match s.fail_rereads {
                Some(class) => Err(GcError::ListProxies {
                    class,
                    source: "injected Proxy read failure".into(),
                }),
                None => Ok(s.owners.get(uid).cloned()),
            }
        })
    }
}

/// Why an instance is collected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrphanReason {
    /// No Proxy has its UID.
    NoProxy,
    /// Its Proxy's status names another instance.
    Duplicate {
        /// The instance the status names.
        named: InstanceId,
    },
}

impl OrphanReason {
    /// Stable label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            OrphanReason::NoProxy => "no-proxy",
            OrphanReason::Duplicate { .. } => "duplicate",
        }
    }
}

/// Why an instance is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepReason {
    /// Its mark has no owner UID (cannot happen through a correct provider).
    NoOwnerUid,
    /// Its Proxy's status names it.
    Named,
    /// Its Proxy names no instance yet: a Create may be about to write this one.
    NotYetNamed,
    /// Its Proxy names another instance but is provisioning: a Create of a replacement
    /// (or an adoption of this very instance) may be in flight and own it.
    CreateInProgress,
    /// The fresh read of its Proxy right before the delete failed: nothing is deleted
    /// on a guess.
    Unconfirmed {
        /// Class of the failed read.
        class: ErrorClass,
    },
    /// It is an orphan, but younger than the grace period.
    Young {
        /// Age in seconds (negative if the host's clock is ahead).
        age_seconds: i64,
    },
    /// Its `created_at` does not parse as RFC 3339: what cannot be dated is not deleted.
    Undatable {
        /// The value found.
        created_at: String,
    },
}

/// An instance of one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRef {
    /// Provider name.
    pub provider: String,
    /// The instance.
    pub id: InstanceId,
}

/// A target whose listing failed: nothing on it was judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedTarget {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
    /// Class of the failure.
    pub class: ErrorClass,
    /// The failure.
    pub message: String,
}

/// An instance kept, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The instance.
    pub instance: InstanceRef,
    /// Why.
    pub reason: KeepReason,
}

/// An instance deleted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// The instance.
    pub instance: InstanceRef,
    /// The UID in its mark.
    pub proxy_uid: String,
    /// Why.
    pub reason: OrphanReason,
}

/// A delete that failed.
#[derive(Debug)]
pub struct FailedDelete {
    /// The instance.
    pub instance: InstanceRef,
    /// Why it was to be deleted.
    pub reason: OrphanReason,
    /// The failure.
    pub error: GcError,
}

/// What one sweep saw and did.
#[derive(Debug, Default)]
pub struct GcReport {
    /// Every instance listed (on targets that answered).
    pub seen: Vec<InstanceRef>,
    /// Targets whose listing failed.
    pub skipped_targets: Vec<SkippedTarget>,
    /// Set when the Proxies could not be listed: then nothing was judged or deleted.
    pub owners_error: Option<GcError>,
    /// Instances judged and kept.
    pub kept: Vec<Kept>,
    /// Instances deleted.
    pub deleted: Vec<Deleted>,
    /// Deletes that failed.
    pub failed: Vec<FailedDelete>,
    /// Set when shutdown stopped the sweep before it judged everything.
    pub interrupted: bool,
    /// Proxies whose status names an instance on a host no provider lists any more (the
    /// host was removed from the config): that VM is abandoned, not collected.
    pub unconfigured: Vec<Unconfigured>,
    /// Leftover volumes deleted.
    pub volumes_deleted: Vec<VolumeRef>,
    /// Leftover volumes kept, and why.
    pub volumes_kept: Vec<(VolumeRef, VolumeKeep)>,
    /// Leftover volumes whose delete failed.
    pub volumes_failed: Vec<(VolumeRef, GcError)>,
    /// Targets whose volume listing failed: nothing on them was judged.
    pub volume_targets_skipped: Vec<SkippedTarget>,
}

// ---- Leftover volumes --------------------------------------------------------------
//
// Volumes outlive their domain when a Create fails and its cleanup fails too (or the
// process dies), and the Proxy is then deleted: nothing would ever name them again, and
// the seed holds the Proxy's user-data. Images removed from the config leave their base
// volumes, markers and half-made staging volumes. A [`VolumeCollector`] (a provider that
// has volumes) lists such candidates per target, by name only (names it makes itself),
// and the collector decides here. A volume has no creation time libvirt reports on every
// pool type, so "older than the grace period" is "seen as a leftover by this process,
// sweep after sweep, for longer than the grace period": a restart starts counting again,
// which errs on the side of keeping.

/// What kind of leftover a [`VolumeCandidate`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VolumeKind {
    /// An instance's root and seed volumes with no domain of that instance on the host.
    Instance,
    /// Staging leftovers of an image no longer configured: a data volume never verified,
    /// or a marker or takeover claim without its data volume.
    Staging,
    /// The verified base of an image no longer configured, used by no volume.
    UnusedImage,
}

impl VolumeKind {
    /// Stable label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeKind::Instance => "instance",
            VolumeKind::Staging => "staging",
            VolumeKind::UnusedImage => "unused-image",
        }
    }
}

/// Volumes a [`VolumeCollector`] offers for collection as one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeCandidate {
    /// Stable key on its target: the instance's domain name, or the image's data volume
    /// name.
    pub key: String,
    /// What it is.
    pub kind: VolumeKind,
    /// For [`VolumeKind::Instance`]: the Proxy UID the volume names carry.
    pub owner_uid: Option<String>,
    /// The volume names, in the order they are deleted.
    pub volumes: Vec<String>,
}

/// One target's candidates, or why it could not be listed.
#[derive(Debug)]
pub struct VolumeListing {
    /// Target (host) name.
    pub target: String,
    /// Candidates; an error means "unknown", never "none".
    pub result: Result<Vec<VolumeCandidate>, ProviderError>,
}

/// What a [`VolumeCollector::delete_volumes`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeDeleteOutcome {
    /// The volumes are gone.
    Deleted,
    /// The provider's own check right before the delete found the candidate no longer a
    /// leftover (a domain of that instance appeared, a volume now uses the image); nothing
    /// was deleted.
    Changed(String),
}

/// A provider whose leftover volumes the collector sweeps.
pub trait VolumeCollector: Send + Sync {
    /// Provider name (for logs and metrics).
    fn name(&self) -> &str;
    /// Every target's leftover candidates. A target whose listing fails is reported as
    /// failed, never as empty.
    fn volume_candidates(&self) -> BoxFuture<'_, Vec<VolumeListing>>;
    /// Deletes a candidate's volumes after checking, under the provider's own locks, that
    /// it is still a leftover.
    fn delete_volumes<'a>(
        &'a self,
        target: &'a str,
        candidate: &'a VolumeCandidate,
    ) -> BoxFuture<'a, Result<VolumeDeleteOutcome, ProviderError>>;
}

/// A volume candidate on a target of a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRef {
    /// Provider name.
    pub provider: String,
    /// Target (host).
    pub target: String,
    /// The candidate's key.
    pub key: String,
    /// Its kind.
    pub kind: VolumeKind,
}

/// Why leftover volumes were kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeKeep {
    /// A Proxy with the UID in their names exists: its Create may be making them.
    ProxyExists,
    /// Not yet seen as a leftover for longer than required.
    Young {
        /// Seconds this process has seen it as a leftover.
        seen_for_seconds: i64,
    },
    /// One of the `keepUnused` most recently unused retired images of its host.
    Policy,
    /// The provider's check right before the delete found it in use again.
    Changed(String),
}

/// An instance a Proxy names on a host that is not configured any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unconfigured {
    /// The instance the Proxy's status names.
    pub instance: InstanceId,
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name.
    pub name: String,
}

impl GcReport {
    /// IDs of the deleted instances.
    pub fn deleted_ids(&self) -> Vec<&InstanceId> {
        self.deleted.iter().map(|d| &d.instance.id).collect()
    }

    /// Why `id` was kept, if it was.
    pub fn kept_reason(&self, id: &InstanceId) -> Option<&KeepReason> {
        self.kept
            .iter()
            .find(|k| &k.instance.id == id)
            .map(|k| &k.reason)
    }

    fn result(&self) -> &'static str {
        if self.owners_error.is_some() {
            "skipped"
        } else if self.interrupted {
            "interrupted"
        } else if !self.skipped_targets.is_empty() || !self.volume_targets_skipped.is_empty() {
            "partial"
        } else {
            "ok"
        }
    }
}

/// Labels: sweep result (`ok`, `partial`, `skipped`, `interrupted`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepLabels {
    /// Result.
    pub result: String,
}

/// Labels: provider.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabel {
    /// Provider name.
    pub provider: String,
}

/// Labels: provider and orphan reason (`no-proxy`, `duplicate`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OrphanLabels {
    /// Provider name.
    pub provider: String,
    /// Reason.
    pub reason: String,
}

/// Labels: provider and delete outcome (`ok` or the error class).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeleteLabels {
    /// Provider name.
    pub provider: String,
    /// Outcome.
    pub outcome: String,
}

/// Labels: provider and target.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
}

/// Garbage collector metrics.
#[derive(Debug, Clone, Default)]
pub struct GcMetrics {
    sweeps: Family<SweepLabels, Counter>,
    seen: Family<ProviderLabel, Counter>,
    orphans: Family<OrphanLabels, Counter>,
    deletes: Family<DeleteLabels, Counter>,
    skipped: Family<TargetLabels, Counter>,
    last_sweep_timestamp: Gauge<f64, AtomicU64>,
    last_sweep_duration: Gauge<f64, AtomicU64>,
    unconfigured: Family<HostLabel, Gauge>,
    volume_candidates: Family<VolumeLabels, Counter>,
    volume_deletes: Family<VolumeDeleteLabels, Counter>,
    volume_skipped: Family<TargetLabels, Counter>,
    /// Hosts the gauge above was last set for, so a host that no longer has any is set
    /// back to zero instead of keeping its last count.
    unconfigured_hosts: Arc<Mutex<std::collections::BTreeSet<String>>>,
}

/// Labels: provider and volume kind (`instance`, `staging`, `unused-image`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeLabels {
    /// Provider name.
    pub provider: String,
    /// Kind.
    pub kind: String,
}

/// Labels: provider, volume kind and delete outcome (`ok`, `changed` or the error class).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeDeleteLabels {
    /// Provider name.
    pub provider: String,
    /// Kind.
    pub kind: String,
    /// Outcome.
    pub outcome: String,
}

/// Labels: a host name.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HostLabel {
    /// Host name.
    pub host: String,
}

impl GcMetrics {
    /// Metrics registered under `egress_gc_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_gc_sweeps",
            "garbage collection sweeps by result (ok, partial, skipped, interrupted)",
            m.sweeps.clone(),
        );
        registry.register(
            "egress_gc_instances_seen",
            "instances listed by garbage collection sweeps, by provider",
            m.seen.clone(),
        );
        registry.register(
            "egress_gc_orphans",
            "instances past the grace period found to be collected, by provider and reason",
            m.orphans.clone(),
        );
        registry.register(
            "egress_gc_deletes",
            "deletes by the garbage collector, by provider and outcome (ok or error class)",
            m.deletes.clone(),
        );
        registry.register(
            "egress_gc_targets_skipped",
            "targets skipped by a sweep because their listing failed",
            m.skipped.clone(),
        );
        registry.register(
            "egress_gc_last_sweep_timestamp_seconds",
            "when the last sweep that ran to its end finished (Unix time)",
            m.last_sweep_timestamp.clone(),
        );
        registry.register(
            "egress_gc_volume_candidates",
            "leftover volume groups listed by sweeps, by provider and kind (instance, \
             staging, unused-image)",
            m.volume_candidates.clone(),
        );
        registry.register(
            "egress_gc_volume_deletes",
            "leftover volume groups deleted by the collector, by provider, kind and outcome \
             (ok, changed, or the error class)",
            m.volume_deletes.clone(),
        );
        registry.register(
            "egress_gc_volume_targets_skipped",
            "targets whose leftover volumes a sweep skipped because their listing failed",
            m.volume_skipped.clone(),
        );
        registry.register(
            "egress_gc_unconfigured_host_instances",
            "instances Proxies name on a host that is not in the config any more (abandoned \
             there: neither watched nor collected), by host, as of the last sweep",
            m.unconfigured.clone(),
        );
        registry.register(
            "egress_gc_last_sweep_duration_seconds",
            "how long the last sweep that ran to its end took",
            m.last_sweep_duration.clone(),
        );
        m
    }

    /// Sweeps counted with this result (for tests).
    pub fn sweeps(&self, result: &str) -> u64 {
        self.sweeps
            .get_or_create(&SweepLabels {
                result: result.into(),
            })
            .get()
    }

    /// Deletes counted with this outcome (for tests).
    pub fn deletes(&self, provider: &str, outcome: &str) -> u64 {
        self.deletes
            .get_or_create(&DeleteLabels {
                provider: provider.into(),
                outcome: outcome.into(),
            })
            .get()
    }

    /// Leftover volume groups deleted with this outcome (for tests).
    pub fn volume_deletes(&self, provider: &str, kind: VolumeKind, outcome: &str) -> u64 {
        self.volume_deletes
            .get_or_create(&VolumeDeleteLabels {
                provider: provider.into(),
                kind: kind.as_str().into(),
                outcome: outcome.into(),
            })
            .get()
    }

    /// Instances Proxies name on the unconfigured host `host`, as of the last sweep.
    pub fn unconfigured(&self, host: &str) -> i64 {
        self.unconfigured
            .get_or_create(&HostLabel { host: host.into() })
            .get()
    }

    fn record(&self, report: &GcReport, finished: Timestamp, took: Duration) {
        if report.owners_error.is_none() {
            let mut counts: std::collections::BTreeMap<&str, i64> = Default::default();
            for u in &report.unconfigured {
                *counts.entry(u.instance.host.as_str()).or_default() += 1;
            }
            let mut last = match self.unconfigured_hosts.lock() {
                Ok(l) => l,
                Err(p) => p.into_inner(),
            };
            for host in last.iter() {
                if !counts.contains_key(host.as_str()) {
                    self.unconfigured
                        .get_or_create(&HostLabel { host: host.clone() })
                        .set(0);
                }
            }
            for (host, n) in &counts {
                self.unconfigured
                    .get_or_create(&HostLabel {
                        host: (*host).to_string(),
                    })
                    .set(*n);
            }
            *last = counts.keys().map(|h| (*h).to_string()).collect();
        }
        self.sweeps
            .get_or_create(&SweepLabels {
                result: report.result().into(),
            })
            .inc();
        for s in &report.seen {
            self.seen
                .get_or_create(&ProviderLabel {
                    provider: s.provider.clone(),
                })
                .inc();
        }
        for t in &report.skipped_targets {
            self.skipped
                .get_or_create(&TargetLabels {
                    provider: t.provider.clone(),
                    target: t.target.clone(),
                })
                .inc();
        }
        let judged = report
            .deleted
            .iter()
            .map(|d| (&d.instance, &d.reason, "ok"))
            .chain(
                report
                    .failed
                    .iter()
                    .map(|f| (&f.instance, &f.reason, f.error.class().as_str())),
            );
        for (instance, reason, outcome) in judged {
            self.orphans
                .get_or_create(&OrphanLabels {
                    provider: instance.provider.clone(),
                    reason: reason.as_str().into(),
                })
                .inc();
            self.deletes
                .get_or_create(&DeleteLabels {
                    provider: instance.provider.clone(),
                    outcome: outcome.into(),
                })
                .inc();
        }
        let volumes =
            report
                .volumes_deleted
                .iter()
                .map(|v| (v, "ok"))
                .chain(report.volumes_kept.iter().filter_map(|(v, k)| {
                    matches!(k, VolumeKeep::Changed(_)).then_some((v, "changed"))
                }))
                .chain(
                    report
                        .volumes_failed
                        .iter()
                        .map(|(v, e)| (v, e.class().as_str())),
                );
        for (v, outcome) in volumes {
            self.volume_deletes
                .get_or_create(&VolumeDeleteLabels {
                    provider: v.provider.clone(),
                    kind: v.kind.as_str().into(),
                    outcome: outcome.into(),
                })
                .inc();
        }
        for v in report
            .volumes_deleted
            .iter()
            .chain(report.volumes_kept.iter().map(|(v, _)| v))
            .chain(report.volumes_failed.iter().map(|(v, _)| v))
        {
            self.volume_candidates
                .get_or_create(&VolumeLabels {
                    provider: v.provider.clone(),
                    kind: v.kind.as_str().into(),
                })
                .inc();
        }
        for t in &report.volume_targets_skipped {
            self.volume_skipped
                .get_or_create(&TargetLabels {
                    provider: t.provider.clone(),
                    target: t.target.clone(),
                })
                .inc();
        }
        if report.owners_error.is_none() && !report.interrupted {
            self.last_sweep_timestamp
                .set(finished.as_millisecond() as f64 / 1000.0);
            self.last_sweep_duration.set(took.as_secs_f64());
        }
    }
}

/// The instances Proxies name on hosts no provider listed (configured hosts are always
/// listed, a failed listing included), sorted for stable reports.
fn unconfigured(
    owners: &HashMap<String, Owner>,
    targets: &std::collections::HashSet<String>,
) -> Vec<Unconfigured> {
    let mut out: Vec<Unconfigured> = owners
        .values()
        .filter_map(|o| {
            let id = o.instance_id.as_ref()?;
            (!targets.contains(&id.host)).then(|| Unconfigured {
                instance: id.clone(),
                namespace: o.namespace.clone(),
                name: o.name.clone(),
            })
        })
        .collect();
    out.sort_by(|a, b| {
        let key = |u: &Unconfigured| {
            (
                u.instance.host.clone(),
                u.instance.name.clone(),
                u.namespace.clone(),
                u.name.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    out
}

/// Decides one instance's fate. Pure, so every rule is tested on its own.
fn judge(
    instance: &Instance,
    owners: &HashMap<String, Owner>,
    now: Timestamp,
    grace: SignedDuration,
) -> Result<OrphanReason, KeepReason> {
    if instance.proxy.uid.is_empty() {
        return Err(KeepReason::NoOwnerUid);
    }
    let reason = match owners.get(&instance.proxy.uid) {
        None => OrphanReason::NoProxy,
        Some(owner) => match &owner.instance_id {
            None => return Err(KeepReason::NotYetNamed),
            Some(named) if *named == instance.id => return Err(KeepReason::Named),
            Some(_) if owner.provisioning => return Err(KeepReason::CreateInProgress),
            Some(named) => OrphanReason::Duplicate {
                named: named.clone(),
            },
        },
    };
    let Ok(created) = instance.created_at.parse::<Timestamp>() else {
        return Err(KeepReason::Undatable {
            created_at: instance.created_at.clone(),
        });
    };
    let age = now.duration_since(created);
    if age <= grace {
        return Err(KeepReason::Young {
            age_seconds: age.as_secs(),
        });
    }
    Ok(reason)
}

/// Lets [`GarbageCollector::run`] stop a sweep between deletes, and tells it whether a
/// delete is in flight (then it waits for it instead of dropping it half-way).
#[derive(Debug, Default)]
struct SweepControl {
    stop: AtomicBool,
    in_delete: AtomicBool,
}

/// Where "now" comes from; injectable so the grace period is tested without sleeping.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// Sweeps every provider for instances to collect.
pub struct GarbageCollector {
    providers: Vec<SharedProvider>,
    index: Arc<dyn ProxyIndex>,
    period: Duration,
    grace: SignedDuration,
    metrics: GcMetrics,
    clock: Clock,
    volumes: Vec<Arc<dyn VolumeCollector>>,
    retired: RetiredImagesPolicy,
    /// When each leftover volume group was first seen, by provider, target and key.
    first_seen: Mutex<HashMap<(String, String, String), Timestamp>>,
}

impl std::fmt::Debug for GarbageCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let providers: Vec<&str> = self.providers.iter().map(|p| p.name()).collect();
        f.debug_struct("GarbageCollector")
            .field("providers", &providers)
            .field("period", &self.period)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl GarbageCollector {
    /// A collector over `providers`, with period and grace period from `config`.
    pub fn new(
        providers: Vec<SharedProvider>,
        index: Arc<dyn ProxyIndex>,
        config: &GcConfig,
        metrics: GcMetrics,
    ) -> Self {
        Self {
            providers,
            index,
            // A zero period would make `tokio::time::interval` panic; the schema forbids
            // it, this keeps a hand-built config from crashing the operator.
            period: Duration::from_secs(u64::from(config.period_seconds.max(1))),
            grace: SignedDuration::from_secs(i64::from(config.grace_period_seconds)),
            metrics,
            clock: Arc::new(Timestamp::now),
            volumes: Vec::new(),
            retired: config.retired_images.clone(),
            first_seen: Mutex::new(HashMap::new()),
        }
    }

    /// Also sweeps the leftover volumes of these providers.
    pub fn with_volumes(mut self, collectors: Vec<Arc<dyn VolumeCollector>>) -> Self {
        self.volumes = collectors;
        self
    }

    /// Replaces the clock (tests).
    pub fn with_clock(mut self, clock: impl Fn() -> Timestamp + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The metrics.
    pub fn metrics(&self) -> &GcMetrics {
        &self.metrics
    }

    /// One sweep at the clock's "now".
    pub async fn sweep_once(&self) -> GcReport {
        self.sweep(&SweepControl::default()).await
    }

    async fn sweep(&self, ctl: &SweepControl) -> GcReport {
        let started = Instant::now();
        let now = (self.clock)();
        let mut report = GcReport::default();

        // Instances first, Proxies second: a Proxy that existed when an instance was
        // listed is then always in the owner set, so only the grace period has to cover
        // Proxies created during the sweep.
        let mut candidates: Vec<(&SharedProvider, Instance)> = Vec::new();
        let mut targets = std::collections::HashSet::new();
        for provider in &self.providers {
            for listing in provider.list().await {
                targets.insert(listing.target.clone());
                match listing.result {
                    Ok(instances) => {
                        for instance in instances {
                            report.seen.push(InstanceRef {
                                provider: provider.name().into(),
                                id: instance.id.clone(),
                            });
                            candidates.push((provider, instance));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(provider = provider.name(), target = %listing.target, class = %e.class(), error = %e, "gc: listing failed; target skipped this round");
                        report.skipped_targets.push(SkippedTarget {
                            provider: provider.name().into(),
                            target: listing.target,
                            class: e.class(),
                            message: e.to_string(),
                        });
                    }
                }
            }
        }

        let owners = match self.index.owners().await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(class = %e.class(), error = %e, "gc: cannot list Proxies; nothing is deleted this round");
                report.owners_error = Some(e);
                self.finish(&report, started);
                return report;
            }
        };
        report.unconfigured = unconfigured(&owners, &targets);
        for u in &report.unconfigured {
            tracing::warn!(instance = %u.instance, proxy = %format_args!("{}/{}", u.namespace, u.name),
                "gc: a Proxy names an instance on a host that is not configured any more; it is neither watched nor collected there");
        }

        for (provider, instance) in candidates {
            let at = InstanceRef {
                provider: provider.name().into(),
                id: instance.id.clone(),
            };
            if let Err(keep) = judge(&instance, &owners, now, self.grace) {
                if let KeepReason::Undatable { created_at } = &keep {
                    tracing::warn!(provider = provider.name(), instance = %instance.id, created_at, "gc: creation time unreadable; instance kept");
                }
                report.kept.push(Kept {
                    instance: at,
                    reason: keep,
                });
                continue;
            }
            if ctl.stop.load(Ordering::SeqCst) {
                report.interrupted = true;
                break;
            }
            // The listing may be minutes old by now (earlier deletes wait for graceful
            // shutdowns): judge again on a fresh read of this one Proxy, so a status
            // written since (a replacement named, a Create started) is honoured.
            let reason = match self.recheck(&instance, now).await {
                Ok(reason) => reason,
                Err(keep) => {
                    tracing::info!(provider = provider.name(), instance = %instance.id, reason = ?keep, "gc: kept after re-reading its Proxy");
                    report.kept.push(Kept {
                        instance: at,
                        reason: keep,
                    });
                    continue;
                }
            };
            ctl.in_delete.store(true, Ordering::SeqCst);
            let outcome = provider.delete(&instance.id).await;
            ctl.in_delete.store(false, Ordering::SeqCst);
            match outcome {
                Ok(()) => {
                    tracing::info!(
                        provider = provider.name(),
                        instance = %instance.id,
                        proxy_uid = %instance.proxy.uid,
                        proxy = %format_args!("{}/{}", instance.proxy.namespace, instance.proxy.name),
                        reason = reason.as_str(),
                        "gc: deleted instance"
                    );
                    report.deleted.push(Deleted {
                        instance: at,
                        proxy_uid: instance.proxy.uid.clone(),
                        reason,
                    });
                }
                Err(source) => {
                    let error = GcError::Delete {
                        provider: provider.name().into(),
                        instance: instance.id.clone(),
                        source,
                    };
                    tracing::warn!(proxy_uid = %instance.proxy.uid, reason = reason.as_str(), class = %error.class(), error = %error, "gc: delete failed");
                    report.failed.push(FailedDelete {
                        instance: at,
                        reason,
                        error,
                    });
                }
            }
        }
        if !report.interrupted {
            self.sweep_volumes(ctl, &owners, now, &mut report).await;
        }
        self.finish(&report, started);
        report
    }

    /// The leftover volume phase of a sweep: `owners` was listed after the instances,
    /// and so after every volume listing of the previous phase too; each collector lists
    /// its volumes now and the provider checks again under its own locks before a delete.
    async fn sweep_volumes(
        &self,
        ctl: &SweepControl,
        owners: &HashMap<String, Owner>,
        now: Timestamp,
        report: &mut GcReport,
    ) {
        for collector in &self.volumes {
            let provider = collector.name().to_string();
            for listing in collector.volume_candidates().await {
                let candidates = match listing.result {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(provider, target = %listing.target, class = %e.class(), error = %e, "gc: volume listing failed; target skipped this round");
                        report.volume_targets_skipped.push(SkippedTarget {
                            provider: provider.clone(),
                            target: listing.target,
                            class: e.class(),
                            message: e.to_string(),
                        });
                        continue;
                    }
                };
                let target = listing.target;
                let verdicts = self.judge_volumes(&provider, &target, &candidates, owners, now);
                for (candidate, verdict) in candidates.iter().zip(verdicts) {
                    let at = VolumeRef {
                        provider: provider.clone(),
                        target: target.clone(),
                        key: candidate.key.clone(),
                        kind: candidate.kind,
                    };
                    if let Err(keep) = verdict {
                        report.volumes_kept.push((at, keep));
                        continue;
                    }
                    if ctl.stop.load(Ordering::SeqCst) {
                        report.interrupted = true;
                        return;
                    }
                    ctl.in_delete.store(true, Ordering::SeqCst);
                    let outcome = collector.delete_volumes(&target, candidate).await;
                    ctl.in_delete.store(false, Ordering::SeqCst);
                    match outcome {
                        Ok(VolumeDeleteOutcome::Deleted) => {
                            tracing::info!(provider, target, key = %candidate.key, kind = candidate.kind.as_str(), volumes = ?candidate.volumes, "gc: deleted leftover volumes");
                            self.forget(&provider, &target, &candidate.key);
                            report.volumes_deleted.push(at);
                        }
                        Ok(VolumeDeleteOutcome::Changed(why)) => {
                            tracing::info!(provider, target, key = %candidate.key, why, "gc: leftover volumes in use again; kept");
                            self.forget(&provider, &target, &candidate.key);
                            report.volumes_kept.push((at, VolumeKeep::Changed(why)));
                        }
                        Err(source) => {
                            let error = GcError::DeleteVolumes {
                                provider: provider.clone(),
                                target: target.clone(),
                                key: candidate.key.clone(),
                                source,
                            };
                            tracing::warn!(class = %error.class(), error = %error, "gc: deleting leftover volumes failed");
                            report.volumes_failed.push((at, error));
                        }
                    }
                }
            }
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String, String), Timestamp>> {
        match self.first_seen.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        }
    }

    fn forget(&self, provider: &str, target: &str, key: &str) {
        self.seen()
            .remove(&(provider.to_string(), target.to_string(), key.to_string()));
    }

    /// Judges one target's candidates (in order) and updates when each was first seen:
    /// a group that is not listed, or whose Proxy exists, starts counting afresh.
    fn judge_volumes(
        &self,
        provider: &str,
        target: &str,
        candidates: &[VolumeCandidate],
        owners: &HashMap<String, Owner>,
        now: Timestamp,
    ) -> Vec<Result<(), VolumeKeep>> {
        let mut seen = self.seen();
        let key = |k: &str| (provider.to_string(), target.to_string(), k.to_string());
        let listed: std::collections::HashSet<&str> =
            candidates.iter().map(|c| c.key.as_str()).collect();
        seen.retain(|(p, t, k), _| p != provider || t != target || listed.contains(k.as_str()));
        let mut since = Vec::with_capacity(candidates.len());
        for c in candidates {
            let proxy_exists = c
                .owner_uid
                .as_ref()
                .is_some_and(|uid| owners.contains_key(uid));
            if c.kind == VolumeKind::Instance && (c.owner_uid.is_none() || proxy_exists) {
                seen.remove(&key(&c.key));
                since.push(None);
            } else {
                since.push(Some(*seen.entry(key(&c.key)).or_insert(now)));
            }
        }
        drop(seen);

        // The retired-image policy: the `keepUnused` most recently unused are kept.
        let mut unused: Vec<(Timestamp, &str)> = candidates
            .iter()
            .zip(&since)
            .filter(|(c, _)| c.kind == VolumeKind::UnusedImage)
            .filter_map(|(c, s)| Some(((*s)?, c.key.as_str())))
            .collect();
        unused.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        let keep_n = usize::try_from(self.retired.keep_unused).unwrap_or(usize::MAX);
        let kept_by_policy: std::collections::HashSet<&str> =
            unused.iter().take(keep_n).map(|(_, k)| *k).collect();
        let unused_for = SignedDuration::from_secs(i64::from(self.retired.unused_for_seconds));

        candidates
            .iter()
            .zip(since)
            .map(|(c, first)| {
                let Some(first) = first else {
                    return Err(VolumeKeep::ProxyExists);
                };
                if c.kind == VolumeKind::UnusedImage && kept_by_policy.contains(c.key.as_str()) {
                    return Err(VolumeKeep::Policy);
                }
                let age = now.duration_since(first);
                let needed = match c.kind {
                    VolumeKind::UnusedImage => self.grace.max(unused_for),
                    VolumeKind::Instance | VolumeKind::Staging => self.grace,
                };
                if age <= needed {
                    return Err(VolumeKeep::Young {
                        seen_for_seconds: age.as_secs(),
                    });
                }
                Ok(())
            })
            .collect()
    }

    /// Judges `instance` again on a fresh read of the Proxy its mark names.
    async fn recheck(
        &self,
        instance: &Instance,
        now: Timestamp,
    ) -> Result<OrphanReason, KeepReason> {
        let p = &instance.proxy;
        let fresh = match self.index.owner(&p.uid, &p.namespace, &p.name).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(instance = %instance.id, class = %e.class(), error = %e, "gc: cannot re-read the Proxy; instance kept this round");
                return Err(KeepReason::Unconfirmed { class: e.class() });
            }
        };
        let owners: HashMap<String, Owner> =
            fresh.map(|o| (p.uid.clone(), o)).into_iter().collect();
        judge(instance, &owners, now, self.grace)
    }

    fn finish(&self, report: &GcReport, started: Instant) {
        let took = started.elapsed();
        self.metrics.record(report, Timestamp::now(), took);
        tracing::info!(
            result = report.result(),
            seen = report.seen.len(),
            kept = report.kept.len(),
            deleted = report.deleted.len(),
            failed = report.failed.len(),
            skipped_targets = report.skipped_targets.len(),
            duration_ms = took.as_millis() as u64,
            "gc: sweep done"
        );
    }

    /// Sweeps every period until `shutdown` completes. On shutdown a sweep stops at once,
    /// except that a delete in flight is finished (a half-done delete would leave
    /// volumes behind until the next sweep).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut ticks = tokio::time::interval(self.period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            period_s = self.period.as_secs(),
            grace_s = self.grace.as_secs(),
            "gc: started"
        );
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = ticks.tick() => {}
            }
            let ctl = SweepControl::default();
            let mut sweep = std::pin::pin!(self.sweep(&ctl));
            let stopped = tokio::select! {
                biased;
                _ = &mut sweep => false,
                () = &mut shutdown => true,
            };
            if stopped {
                ctl.stop.store(true, Ordering::SeqCst);
                if ctl.in_delete.load(Ordering::SeqCst) {
                    let _ = sweep.await;
                }
                break;
            }
        }
        tracing::info!("gc: stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fake::FakeProvider;
    use crate::provider::{
        CreateRequest, InstanceState, Provider, ProviderError, ProxyRef, TargetListing,
    };
    use tokio::sync::Notify;

    const GRACE: u32 = 600;

    fn now() -> Timestamp {
        "2026-03-01T12:00:00Z".parse().unwrap()
    }

    fn ago(secs: i64) -> String {
        (now() - SignedDuration::from_secs(secs)).to_string()
    }

    fn id(host: &str, name: &str) -> InstanceId {
        InstanceId {
            host: host.into(),
            name: name.into(),
        }
    }

    fn instance(host: &str, uid: &str, created_at: &str) -> Instance {
        Instance {
            id: id(host, &format!("egress-{uid}")),
            proxy: ProxyRef {
                namespace: "ns".into(),
                name: format!("p-{uid}"),
                uid: uid.into(),
            },
            state: InstanceState::Running,
            addresses: vec![],
            address_source: None,
            seed_applied: None,
            created_at: created_at.into(),
        }
    }

    fn owner(instance_id: Option<InstanceId>) -> Owner {
        Owner {
            namespace: "ns".into(),
            name: "p".into(),
            instance_id,
            deleting: false,
            provisioning: false,
        }
    }

    fn collector(
        providers: Vec<SharedProvider>,
        index: Arc<FakeProxyIndex>,
        metrics: GcMetrics,
    ) -> GarbageCollector {
        let config = GcConfig {
            period_seconds: 3600,
            grace_period_seconds: GRACE,
            ..GcConfig::default()
        };
        GarbageCollector::new(providers, index, &config, metrics).with_clock(now)
    }

    fn setup(targets: &[&str]) -> (Arc<FakeProvider>, Arc<FakeProxyIndex>, GarbageCollector) {
        let fake = Arc::new(FakeProvider::new(targets));
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![fake.clone()], index.clone(), GcMetrics::default());
        (fake, index, gc)
    }

    fn ids(fake: &FakeProvider) -> Vec<InstanceId> {
        fake.instances().into_iter().map(|i| i.id).collect()
    }

    fn deletes(fake: &FakeProvider) -> usize {
        fake.calls().iter().filter(|c| **c == "delete").count()
    }

    #[tokio::test]
    async fn an_orphan_past_the_grace_period_is_deleted() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(i64::from(GRACE) + 1)));
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted_ids(), vec![&id("a", "egress-u1")]);
        assert_eq!(report.deleted[0].reason, OrphanReason::NoProxy);
        assert_eq!(report.deleted[0].proxy_uid, "u1");
        assert!(ids(&fake).is_empty());
    }

    #[tokio::test]
    async fn an_orphan_within_the_grace_period_is_kept() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(i64::from(GRACE) - 1)));
        let report = gc.sweep_once().await;
        assert!(report.deleted.is_empty());
        assert!(matches!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(KeepReason::Young { age_seconds: 599 })
        ));
        assert_eq!(deletes(&fake), 0);
        assert_eq!(ids(&fake).len(), 1);
    }

    #[tokio::test]
    async fn an_instance_that_cannot_be_dated_is_kept() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", "last tuesday"));
        let report = gc.sweep_once().await;
        assert_eq!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(&KeepReason::Undatable {
                created_at: "last tuesday".into()
            })
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn a_failed_target_listing_skips_that_target_only() {
        let (fake, _index, gc) = setup(&["a", "b"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u2", &ago(7200)));
        fake.set_down("a", true);
        let report = gc.sweep_once().await;
        assert_eq!(report.skipped_targets.len(), 1);
        assert_eq!(report.skipped_targets[0].target, "a");
        assert_eq!(report.skipped_targets[0].class, ErrorClass::Transient);
        assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u2")]);
        assert!(report.failed.is_empty(), "no delete was tried on target a");
        assert_eq!(deletes(&fake), 1);
        assert_eq!(ids(&fake), vec![id("a", "egress-u1")]);
        assert_eq!(gc.metrics().sweeps("partial"), 1);
    }

    #[tokio::test]
    async fn a_failed_proxy_listing_deletes_nothing() {
        let (fake, index, gc) = setup(&["a", "b"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u2", &ago(7200)));
        index.fail_next(ErrorClass::Transient);
        let report = gc.sweep_once().await;
        assert!(report.owners_error.is_some());
        assert!(report.deleted.is_empty() && report.failed.is_empty());
        assert_eq!(deletes(&fake), 0);
        assert_eq!(ids(&fake).len(), 2);
        assert_eq!(gc.metrics().sweeps("skipped"), 1);
        // The same instances are collected once the Proxies can be listed.
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted.len(), 2);
    }

    #[tokio::test]
    async fn a_duplicate_past_the_grace_period_is_deleted_and_the_named_one_kept() {
        let (fake, index, gc) = setup(&["a", "b", "c"]);
        let named = id("a", "egress-u1");
        index.insert("u1", owner(Some(named.clone())));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u1", &ago(7200)));
        fake.insert(instance("c", "u1", &ago(10)));
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u1")]);
        assert_eq!(
            report.deleted[0].reason,
            OrphanReason::Duplicate {
                named: named.clone()
            }
        );
        assert_eq!(report.kept_reason(&named), Some(&KeepReason::Named));
        assert!(matches!(
            report.kept_reason(&id("c", "egress-u1")),
            Some(KeepReason::Young { .. })
        ));
        assert_eq!(ids(&fake), vec![named, id("c", "egress-u1")]);
    }

    #[tokio::test]
    async fn a_proxy_that_names_no_instance_yet_keeps_all_of_its_instances() {
        let (fake, index, gc) = setup(&["a", "b"]);
        index.insert("u1", owner(None));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u1", &ago(7200)));
        let report = gc.sweep_once().await;
        assert!(report.deleted.is_empty());
        assert_eq!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(&KeepReason::NotYetNamed)
        );
        assert_eq!(
            report.kept_reason(&id("b", "egress-u1")),
            Some(&KeepReason::NotYetNamed)
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn an_instance_without_an_owner_uid_is_kept() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "", &ago(7200)));
        let report = gc.sweep_once().await;
        assert_eq!(
            report.kept_reason(&id("a", "egress-")),
            Some(&KeepReason::NoOwnerUid)
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn a_failed_delete_does_not_stop_the_sweep() {
        let (fake, _index, gc) = setup(&["a"]);
        for uid in ["u1", "u2", "u3"] {
            fake.insert(instance("a", uid, &ago(7200)));
        }
        fake.fail_next("delete", ErrorClass::Transient);
        let report = gc.sweep_once().await;
        assert_eq!(report.failed.len(), 1);
        assert_eq!(report.failed[0].error.class(), ErrorClass::Transient);
        assert_eq!(report.failed[0].instance.id, id("a", "egress-u1"));
        assert_eq!(report.deleted.len(), 2);
        assert_eq!(ids(&fake), vec![id("a", "egress-u1")]);
        assert_eq!(gc.metrics().deletes("fake", "transient"), 1);
        assert_eq!(gc.metrics().deletes("fake", "ok"), 2);
    }

    #[tokio::test]
    async fn a_sweep_is_counted_in_the_metrics() {
        let mut registry = Registry::default();
        let metrics = GcMetrics::register(&mut registry);
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![fake.clone()], index.clone(), metrics);
        index.insert("u2", owner(Some(id("a", "egress-u2"))));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("a", "u2", &ago(7200)));
        fake.insert(instance("a", "u3", &ago(7200)));
        fake.set_down("b", true);
        fake.fail_next("delete", ErrorClass::Quota);
        gc.sweep_once().await;

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "egress_gc_sweeps_total{result=\"partial\"} 1",
            "egress_gc_instances_seen_total{provider=\"fake\"} 3",
            "egress_gc_orphans_total{provider=\"fake\",reason=\"no-proxy\"} 2",
            "egress_gc_deletes_total{provider=\"fake\",outcome=\"quota\"} 1",
            "egress_gc_deletes_total{provider=\"fake\",outcome=\"ok\"} 1",
            "egress_gc_targets_skipped_total{provider=\"fake\",target=\"b\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        let stamp = text
            .lines()
            .find_map(|l| l.strip_prefix("egress_gc_last_sweep_timestamp_seconds "))
            .unwrap();
        assert!(stamp.parse::<f64>().unwrap() > 1.0e9, "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("egress_gc_last_sweep_duration_seconds ")),
            "{text}"
        );
    }

    #[tokio::test]
    async fn run_stops_on_shutdown() {
        let (fake, index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gc.run(async move {
            let _ = rx.await;
        }));
        // The first tick is immediate: wait for that sweep, then ask to stop while the
        // collector waits an hour for the next one.
        tokio::time::timeout(Duration::from_secs(5), async {
            while ids(&fake).len() == 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        assert_eq!(index.calls(), 1);
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("run() did not stop on shutdown")
            .unwrap();
    }

    /// Delegates to a [`FakeProvider`], but every delete waits to be released.
    struct Gated {
        inner: Arc<FakeProvider>,
        entered: Notify,
        release: Notify,
    }

    impl Provider for Gated {
        fn name(&self) -> &str {
            "gated"
        }
        fn create<'a>(
            &'a self,
            req: &'a CreateRequest,
        ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            self.inner.create(req)
        }
        fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            self.inner.get(id)
        }
        fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
            Box::pin(async move {
                self.entered.notify_one();
                self.release.notified().await;
                self.inner.delete(id).await
            })
        }
        fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
            self.inner.list()
        }
    }

    #[tokio::test]
    async fn shutdown_during_a_delete_finishes_that_delete_and_starts_no_other() {
        let fake = Arc::new(FakeProvider::new(&["a"]));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("a", "u2", &ago(7200)));
        let gated = Arc::new(Gated {
            inner: fake.clone(),
            entered: Notify::new(),
            release: Notify::new(),
        });
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![gated.clone()], index, GcMetrics::default());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gc.run(async move {
            let _ = rx.await;
        }));
        tokio::time::timeout(Duration::from_secs(5), gated.entered.notified())
            .await
            .unwrap();
        tx.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !task.is_finished(),
            "run() returned with a delete in flight"
        );
        gated.release.notify_one();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("run() did not stop after the delete")
            .unwrap();
        assert_eq!(
            ids(&fake),
            vec![id("a", "egress-u2")],
            "first delete done, second not started"
        );
    }

    #[test]
    fn owners_come_from_uid_status_and_deletion_timestamp() {
        use crate::api::proxy::{ProxySpec, ProxyStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

        let mut p = Proxy::new("web", ProxySpec::default());
        p.metadata.namespace = Some("ns".into());
        assert_eq!(owner_of(&p), None, "no UID: cannot be keyed");

        p.metadata.uid = Some("u1".into());
        let (uid, o) = owner_of(&p).unwrap();
        assert_eq!(uid, "u1");
        assert_eq!((o.namespace.as_str(), o.name.as_str()), ("ns", "web"));
        assert_eq!(o.instance_id, None);
        assert!(!o.deleting);

        p.status = Some(ProxyStatus {
            instance_id: Some("kvm-a/egress-u1".into()),
            ..Default::default()
        });
        p.metadata.deletion_timestamp = Some(Time(now()));
        let (_, o) = owner_of(&p).unwrap();
        assert_eq!(o.instance_id, Some(id("kvm-a", "egress-u1")));
        assert!(o.deleting);

        p.status = Some(ProxyStatus {
            instance_id: Some("not an id".into()),
            ..Default::default()
        });
        assert_eq!(owner_of(&p).unwrap().1.instance_id, None);
        assert!(!owner_of(&p).unwrap().1.provisioning);

        p.status = Some(ProxyStatus {
            instance_id: Some("kvm-a/egress-u1".into()),
            phase: Some(crate::api::proxy::ProxyPhase::Provisioning),
            ..Default::default()
        });
        assert!(owner_of(&p).unwrap().1.provisioning);
    }

    /// The single read against a mock API server: it asks for the one Proxy by namespace
    /// and name, and answers `None` when it is gone (404) or is another object now
    /// (another UID under the same name).
    #[tokio::test]
    async fn the_kubernetes_index_rereads_one_proxy_by_name_and_uid() {
        use http::{Request, Response};
        use kube::client::Body;

        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let mut paths = Vec::new();
            for answer in ["u-a", "u-other", "404"] {
                let (request, send) = handle.next_request().await.expect("a get request");
                paths.push(request.uri().path().to_string());
                let (code, body) = if answer == "404" {
                    (
                        404,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1",
                            "status": "Failure", "code": 404, "reason": "NotFound",
                            "message": "not found"}),
                    )
                } else {
                    (
                        200,
                        serde_json::json!({
                            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
                            "metadata": {"name": "web", "namespace": "ns", "uid": answer},
                            "spec": {"provider": "kvm2"},
                            "status": {"instanceId": "h2/egress-u-a", "phase": "Provisioning"},
                        }),
                    )
                };
                send.send_response(
                    Response::builder()
                        .status(code)
                        .body(Body::from(serde_json::to_vec(&body).unwrap()))
                        .unwrap(),
                );
            }
            paths
        });
        let index = KubeProxyIndex::new(kube::Client::new(service, "default"));
        let found = index.owner("u-a", "ns", "web").await.unwrap().unwrap();
        assert_eq!(found.instance_id, Some(id("h2", "egress-u-a")));
        assert!(found.provisioning);
        assert_eq!(index.owner("u-a", "ns", "web").await.unwrap(), None);
        assert_eq!(index.owner("u-a", "ns", "web").await.unwrap(), None);
        let paths = server.await.unwrap();
        assert!(
            paths
                .iter()
                .all(|p| p == "/apis/egress-operator.dev/v1alpha1/namespaces/ns/proxies/web"),
            "{paths:?}"
        );
    }

    fn provisioning(instance_id: Option<InstanceId>) -> Owner {
        Owner {
            provisioning: true,
            ..owner(instance_id)
        }
    }

    #[tokio::test]
    async fn a_duplicate_of_a_provisioning_proxy_is_kept() {
        let (fake, index, gc) = setup(&["a", "b"]);
        let named = id("a", "egress-u1");
        // The status still names the old instance while a replacement is made on b.
        index.insert("u1", provisioning(Some(named.clone())));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u1", &ago(7200)));
        let report = gc.sweep_once().await;
        assert!(report.deleted.is_empty(), "{:?}", report.deleted);
        assert_eq!(
            report.kept_reason(&id("b", "egress-u1")),
            Some(&KeepReason::CreateInProgress)
        );
        assert_eq!(deletes(&fake), 0);
        // Once the Proxy runs on a, the leftover on b is collected.
        index.insert("u1", owner(Some(named)));
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u1")]);
    }

    #[tokio::test]
    async fn the_proxy_is_read_again_right_before_each_delete() {
        let (fake, index, gc) = setup(&["a", "b"]);
        index.insert("u1", owner(Some(id("a", "egress-u1"))));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u1", &ago(7200)));
        fake.insert(instance("b", "u2", &ago(7200)));
        // The listing is taken before the controller names the instance on b and a
        // Proxy u2 is created (a UID the listing did not have).
        index.freeze_listing();
        index.insert("u1", owner(Some(id("b", "egress-u1"))));
        index.insert("u2", provisioning(None));
        let report = gc.sweep_once().await;
        assert_eq!(
            report.kept_reason(&id("b", "egress-u1")),
            Some(&KeepReason::Named)
        );
        assert_eq!(
            report.kept_reason(&id("b", "egress-u2")),
            Some(&KeepReason::NotYetNamed)
        );
        // The instance on a is now the duplicate, but the listing said it was named:
        // it waits for the next sweep.
        assert_eq!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(&KeepReason::Named)
        );
        assert_eq!(deletes(&fake), 0);
        assert_eq!(index.rereads(), 2);
    }

    #[tokio::test]
    async fn a_failed_reread_deletes_nothing() {
        let (fake, index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        index.fail_rereads(ErrorClass::Transient);
        let report = gc.sweep_once().await;
        assert!(report.deleted.is_empty());
        assert_eq!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(&KeepReason::Unconfirmed {
                class: ErrorClass::Transient
            })
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn instances_on_hosts_no_longer_configured_are_reported() {
        let mut registry = Registry::default();
        let metrics = GcMetrics::register(&mut registry);
        let fake = Arc::new(FakeProvider::new(&["a"]));
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![fake.clone()], index.clone(), metrics);
        index.insert("u1", owner(Some(id("gone", "egress-u1"))));
        index.insert("u2", owner(Some(id("gone", "egress-u2"))));
        index.insert("u3", owner(Some(id("a", "egress-u3"))));
        fake.insert(instance("a", "u3", &ago(7200)));
        let report = gc.sweep_once().await;
        let hosts: Vec<_> = report
            .unconfigured
            .iter()
            .map(|u| u.instance.to_string())
            .collect();
        assert_eq!(hosts, ["gone/egress-u1", "gone/egress-u2"]);
        assert_eq!(gc.metrics().unconfigured("gone"), 2);
        assert_eq!(deletes(&fake), 0);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.lines()
                .any(|l| l == "egress_gc_unconfigured_host_instances{host=\"gone\"} 2"),
            "{text}"
        );
        // Once no Proxy names it, the host's gauge goes back to zero.
        index.remove("u1");
        index.remove("u2");
        gc.sweep_once().await;
        assert_eq!(gc.metrics().unconfigured("gone"), 0);
    }

    /// One target's candidates, or the class its listing fails with.
    type FakeListing = (String, Result<Vec<VolumeCandidate>, ErrorClass>);

    /// A [`VolumeCollector`] over a table of candidates per target.
    #[derive(Default)]
    struct FakeVolumes {
        targets: Mutex<Vec<FakeListing>>,
        changed: Mutex<Vec<String>>,
        deleted: Mutex<Vec<(String, String)>>,
    }

    impl FakeVolumes {
        fn set(&self, target: &str, listing: Result<Vec<VolumeCandidate>, ErrorClass>) {
            let mut t = self.targets.lock().unwrap();
            t.retain(|(n, _)| n != target);
            t.push((target.into(), listing));
        }
        fn deleted(&self) -> Vec<(String, String)> {
            self.deleted.lock().unwrap().clone()
        }
    }

    impl VolumeCollector for FakeVolumes {
        fn name(&self) -> &str {
            "fake"
        }
        fn volume_candidates(&self) -> BoxFuture<'_, Vec<VolumeListing>> {
            let out = self
                .targets
                .lock()
                .unwrap()
                .iter()
                .map(|(t, l)| VolumeListing {
                    target: t.clone(),
                    result: match l {
                        Ok(c) => Ok(c.clone()),
                        Err(class) => Err(ProviderError::msg(*class, "listing failed")),
                    },
                })
                .collect();
            Box::pin(std::future::ready(out))
        }
        fn delete_volumes<'a>(
            &'a self,
            target: &'a str,
            candidate: &'a VolumeCandidate,
        ) -> BoxFuture<'a, Result<VolumeDeleteOutcome, ProviderError>> {
            let out = if self.changed.lock().unwrap().contains(&candidate.key) {
                VolumeDeleteOutcome::Changed("in use".into())
            } else {
                self.deleted
                    .lock()
                    .unwrap()
                    .push((target.into(), candidate.key.clone()));
                VolumeDeleteOutcome::Deleted
            };
            Box::pin(std::future::ready(Ok(out)))
        }
    }

    fn candidate(key: &str, kind: VolumeKind, uid: Option<&str>) -> VolumeCandidate {
        VolumeCandidate {
            key: key.into(),
            kind,
            owner_uid: uid.map(str::to_string),
            volumes: vec![format!("{key}-vol")],
        }
    }

    /// A collector over `volumes` whose clock reads `at` (seconds after [`now`]).
    fn volume_collector(
        volumes: Arc<FakeVolumes>,
        index: Arc<FakeProxyIndex>,
        retired: RetiredImagesPolicy,
        metrics: GcMetrics,
    ) -> (GarbageCollector, Arc<std::sync::atomic::AtomicI64>) {
        let at = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let clock = at.clone();
        let config = GcConfig {
            period_seconds: 3600,
            grace_period_seconds: GRACE,
            retired_images: retired,
        };
        let gc = GarbageCollector::new(vec![], index, &config, metrics)
            .with_volumes(vec![volumes])
            .with_clock(move || now() + SignedDuration::from_secs(clock.load(Ordering::SeqCst)));
        (gc, at)
    }

    fn policy(keep_unused: u32, unused_for_seconds: u32) -> RetiredImagesPolicy {
        RetiredImagesPolicy {
            keep_unused,
            unused_for_seconds,
        }
    }

    #[tokio::test]
    async fn leftover_instance_volumes_go_after_the_grace_period_unless_their_proxy_exists() {
        let volumes = Arc::new(FakeVolumes::default());
        let index = Arc::new(FakeProxyIndex::new());
        let (gc, at) = volume_collector(
            volumes.clone(),
            index.clone(),
            policy(0, 0),
            GcMetrics::default(),
        );
        index.insert("u2", owner(None));
        volumes.set(
            "a",
            Ok(vec![
                candidate("egress-u1", VolumeKind::Instance, Some("u1")),
                candidate("egress-u2", VolumeKind::Instance, Some("u2")),
            ]),
        );
        let report = gc.sweep_once().await;
        assert!(volumes.deleted().is_empty());
        assert!(report.volumes_kept.iter().any(|(v, k)| v.key == "egress-u1"
            && *k
                == VolumeKeep::Young {
                    seen_for_seconds: 0
                }));
        assert!(
            report
                .volumes_kept
                .iter()
                .any(|(v, k)| v.key == "egress-u2" && *k == VolumeKeep::ProxyExists)
        );

        at.store(i64::from(GRACE), Ordering::SeqCst);
        gc.sweep_once().await;
        assert!(
            volumes.deleted().is_empty(),
            "exactly the grace period is kept"
        );

        at.store(i64::from(GRACE) + 1, Ordering::SeqCst);
        let report = gc.sweep_once().await;
        assert_eq!(
            volumes.deleted(),
            [("a".to_string(), "egress-u1".to_string())]
        );
        assert_eq!(report.volumes_deleted.len(), 1);
        assert_eq!(report.volumes_deleted[0].kind, VolumeKind::Instance);
        assert_eq!(
            gc.metrics()
                .volume_deletes("fake", VolumeKind::Instance, "ok"),
            1
        );
    }

    #[tokio::test]
    async fn a_leftover_counts_from_when_it_was_last_continuously_seen() {
        let volumes = Arc::new(FakeVolumes::default());
        let index = Arc::new(FakeProxyIndex::new());
        let (gc, at) = volume_collector(
            volumes.clone(),
            index.clone(),
            policy(0, 0),
            GcMetrics::default(),
        );
        let c = candidate("egress-u1", VolumeKind::Instance, Some("u1"));
        volumes.set("a", Ok(vec![c.clone()]));
        gc.sweep_once().await;
        // Its Proxy appears (a Create is making it): the count starts again after.
        index.insert("u1", owner(None));
        at.store(300, Ordering::SeqCst);
        gc.sweep_once().await;
        index.remove("u1");
        at.store(700, Ordering::SeqCst);
        gc.sweep_once().await;
        at.store(1200, Ordering::SeqCst);
        gc.sweep_once().await;
        assert!(
            volumes.deleted().is_empty(),
            "seen as a leftover for 500 s only"
        );
        // Not listed for a round (a domain appeared): the count starts again too.
        volumes.set("a", Ok(vec![]));
        at.store(1400, Ordering::SeqCst);
        gc.sweep_once().await;
        volumes.set("a", Ok(vec![c]));
        at.store(1500, Ordering::SeqCst);
        gc.sweep_once().await;
        at.store(2000, Ordering::SeqCst);
        gc.sweep_once().await;
        assert!(volumes.deleted().is_empty());
        at.store(2101, Ordering::SeqCst);
        gc.sweep_once().await;
        assert_eq!(volumes.deleted().len(), 1);
    }

    #[tokio::test]
    async fn no_volume_is_deleted_on_a_target_whose_listing_failed_or_without_proxies() {
        let mut registry = Registry::default();
        let metrics = GcMetrics::register(&mut registry);
        let volumes = Arc::new(FakeVolumes::default());
        let index = Arc::new(FakeProxyIndex::new());
        let (gc, at) = volume_collector(volumes.clone(), index.clone(), policy(0, 0), metrics);
        volumes.set(
            "a",
            Ok(vec![candidate("egress-image-x", VolumeKind::Staging, None)]),
        );
        volumes.set("b", Err(ErrorClass::Transient));
        gc.sweep_once().await;
        at.store(7200, Ordering::SeqCst);
        // The Proxies cannot be listed: nothing at all is judged.
        index.fail_next(ErrorClass::Transient);
        let report = gc.sweep_once().await;
        assert!(report.volumes_deleted.is_empty() && volumes.deleted().is_empty());
        let report = gc.sweep_once().await;
        assert_eq!(
            volumes.deleted(),
            [("a".to_string(), "egress-image-x".to_string())]
        );
        assert_eq!(report.volume_targets_skipped.len(), 1);
        assert_eq!(report.volume_targets_skipped[0].target, "b");
        assert_eq!(report.result(), "partial");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "egress_gc_volume_deletes_total{provider=\"fake\",kind=\"staging\",outcome=\"ok\"} 1",
            "egress_gc_volume_targets_skipped_total{provider=\"fake\",target=\"b\"} 2",
            "egress_gc_volume_candidates_total{provider=\"fake\",kind=\"staging\"} 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[tokio::test]
    async fn unused_retired_images_follow_the_policy() {
        let volumes = Arc::new(FakeVolumes::default());
        let index = Arc::new(FakeProxyIndex::new());
        // Keep the newest unused one; the others go after an hour unused.
        let (gc, at) = volume_collector(
            volumes.clone(),
            index.clone(),
            policy(1, 3600),
            GcMetrics::default(),
        );
        let old = candidate("egress-image-old", VolumeKind::UnusedImage, None);
        let older = candidate("egress-image-older", VolumeKind::UnusedImage, None);
        let newer = candidate("egress-image-newer", VolumeKind::UnusedImage, None);
        volumes.set("a", Ok(vec![old.clone(), older.clone()]));
        gc.sweep_once().await;
        at.store(1800, Ordering::SeqCst);
        volumes.set("a", Ok(vec![old.clone(), older.clone(), newer.clone()]));
        let report = gc.sweep_once().await;
        assert!(
            report
                .volumes_kept
                .iter()
                .any(|(v, k)| v.key == "egress-image-newer" && *k == VolumeKeep::Policy)
        );
        // Past the grace period but not an hour unused: kept.
        assert!(volumes.deleted().is_empty());
        at.store(3601, Ordering::SeqCst);
        let report = gc.sweep_once().await;
        let mut gone: Vec<_> = volumes.deleted().into_iter().map(|(_, k)| k).collect();
        gone.sort();
        assert_eq!(gone, ["egress-image-old", "egress-image-older"]);
        assert!(
            report
                .volumes_kept
                .iter()
                .any(|(v, k)| v.key == "egress-image-newer" && *k == VolumeKeep::Policy)
        );
        // The one kept by the policy stays however long it is unused.
        at.store(100_000, Ordering::SeqCst);
        volumes.set("a", Ok(vec![newer]));
        gc.sweep_once().await;
        assert_eq!(volumes.deleted().len(), 2);
    }

    #[tokio::test]
    async fn a_leftover_the_provider_finds_in_use_again_is_kept_and_counted() {
        let volumes = Arc::new(FakeVolumes::default());
        let index = Arc::new(FakeProxyIndex::new());
        let (gc, at) = volume_collector(
            volumes.clone(),
            index.clone(),
            policy(0, 0),
            GcMetrics::default(),
        );
        volumes.set(
            "a",
            Ok(vec![candidate(
                "egress-u1",
                VolumeKind::Instance,
                Some("u1"),
            )]),
        );
        volumes.changed.lock().unwrap().push("egress-u1".into());
        gc.sweep_once().await;
        at.store(7200, Ordering::SeqCst);
        let report = gc.sweep_once().await;
        assert!(volumes.deleted().is_empty());
        assert!(matches!(report.volumes_kept[0].1, VolumeKeep::Changed(_)));
        assert_eq!(
            gc.metrics()
                .volume_deletes("fake", VolumeKind::Instance, "changed"),
            1
        );
    }

    /// The Kubernetes index against a mock API server: it follows continue tokens across
    /// pages, keys owners by UID with the instance their status names, and a failing page
    /// fails the whole listing (never a partial owner set, which would read as orphans).
    #[tokio::test]
    async fn the_kubernetes_index_reads_every_page_and_fails_whole() {
        use http::{Request, Response};
        use kube::client::Body;

        let proxy = |name: &str, uid: &str, instance: Option<&str>| {
            serde_json::json!({
                "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
                "metadata": {"name": name, "namespace": "ns", "uid": uid},
                "spec": {"provider": "kvm2"},
                "status": instance.map(|i| serde_json::json!({"instanceId": i})),
            })
        };
        let page = |items: Vec<serde_json::Value>, next: &str| {
            serde_json::json!({
                "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyList",
                "metadata": {"resourceVersion": "9", "continue": next}, "items": items,
            })
        };
        for fail_second_page in [false, true] {
            let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let pages = vec![
                page(vec![proxy("a", "u-a", Some("h1/egress-u-a"))], "tok-1"),
                page(vec![proxy("b", "u-b", None)], ""),
            ];
            let server = tokio::spawn(async move {
                let mut queries = Vec::new();
                for (n, body) in pages.into_iter().enumerate() {
                    let (request, send) = handle.next_request().await.expect("a list request");
                    assert_eq!(
                        request.uri().path(),
                        "/apis/egress-operator.dev/v1alpha1/proxies"
                    );
                    queries.push(request.uri().query().unwrap_or_default().to_string());
                    let (code, body) = if n == 1 && fail_second_page {
                        (
                            503,
                            serde_json::json!({"kind": "Status", "apiVersion": "v1",
                                "status": "Failure", "code": 503, "message": "busy"}),
                        )
                    } else {
                        (200, body)
                    };
                    send.send_response(
                        Response::builder()
                            .status(code)
                            .body(Body::from(serde_json::to_vec(&body).unwrap()))
                            .unwrap(),
                    );
                }
                queries
            });
            let index = KubeProxyIndex::new(kube::Client::new(service, "default"));
            let result = index.owners().await;
            let queries = server.await.unwrap();
            assert!(queries[0].contains("limit=500"), "{queries:?}");
            assert!(queries[1].contains("continue=tok-1"), "{queries:?}");
            if fail_second_page {
                let e = result.unwrap_err();
                assert_eq!(e.class(), ErrorClass::Transient, "{e}");
            } else {
                let owners = result.unwrap();
                assert_eq!(owners.len(), 2, "{owners:?}");
                assert_eq!(
                    owners["u-a"].instance_id,
                    Some(InstanceId::parse("h1/egress-u-a").unwrap())
                );
                assert_eq!(owners["u-b"].instance_id, None);
                assert_eq!(owners["u-b"].name, "b");
            }
        }
    }
}
