//! The kvm2 [`Provider`]: a Create, Get, Delete and List over [`HostOps`].
//!
//! A Create follows the brief's steps, each idempotent, so any partial state converges:
//! lock the domain name; adopt a domain of that name that carries our mark for the same
//! Proxy, refuse any other; ensure the verified base image; reuse or create the root
//! overlay; render vendor-data and write the seed ISO; render and define the domain;
//! start it and wait (bounded) until it runs. A failure cleans up what *this* Create
//! made; whatever a crash leaves behind is ours by name and mark, so the next Create
//! adopts or replaces it, and never anything else.
//!
//! Plugin output meets three layers before it runs: the plugin-output check (in the
//! render), libvirt's schema validation at define, and the same check again on libvirt's
//! own reading of the defined domain (its inactive XML), because what matters is what
//! libvirt will run, not what the checker parsed. A domain whose reading fails is
//! undefined with the volumes this Create made and never started; an adopted domain that
//! is not running yet is checked the same way before it is started.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use tokio::sync::Semaphore;

use super::addresses::{self, AddressSource};
use super::index::{self, DomainIndex, Fresh};
use super::ippool::{AddressBook, AllocError};
use super::ops::{Created, DomainRecord, HostOps, OpsError, VolumeEntry};
use super::seed::{self, SeedError, SeedFiles, StaticNet};
use super::volume;
use crate::cluster_identity::{IdentityError, Ownership, Resolved};
use crate::config::{HostConfig, ValidConfig};
use crate::error::{Classified, ErrorClass};
use crate::gc::{VolumeCandidate, VolumeCollector, VolumeDeleteOutcome, VolumeKind, VolumeListing};
use crate::instance::{InstanceIdentity, MetadataMark, VolumeName, fresh_incarnation};
use crate::provider::health::HealthBoard;
use crate::provider::kvm2::image::{ImageCache, ImageCacheOptions, ImageError, ImageMetrics};
use crate::provider::kvm2::locks::KeyedLocks;
use crate::provider::{
    AddressOrigin, BoxFuture, CreateRequest, HealthCheck, Instance, InstanceId, InstanceState,
    Provider, ProviderError, ProxyRef, TargetHealth, TargetListing,
};
use crate::templates::check::{HostPolicy, check_defined_domain_xml_on};
use crate::templates::{
    DomainInput, PluginUnavailable, TemplateError, TemplateErrorKind, TemplateSet,
};
use crate::validation::Problems;

/// The provider's name in the config and in `spec.provider`.
pub const PROVIDER_NAME: &str = "kvm2";

/// A kvm2 failure.
#[derive(Debug, thiserror::Error)]
pub enum Kvm2Error {
    /// The request cannot be served as written.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A domain of our name exists and is not ours.
    #[error(
        "domain {domain:?} on host {host:?} exists and is not this Proxy's ({owner}); \
         refusing to touch it"
    )]
    Foreign {
        /// Host.
        host: String,
        /// Domain name.
        domain: String,
        /// Who it belongs to, as far as we can tell.
        owner: String,
    },
    /// No host can take the instance now.
    #[error("no host can take the instance: {0}")]
    NoCapacity(String),
    /// No host answered.
    #[error("no host is reachable ({0})")]
    Unreachable(String),
    /// The host is at its configured domain limit.
    #[error("host {host:?} already carries {count} proxy domains (maxDomains {max})")]
    HostFull {
        /// Host.
        host: String,
        /// Domains now.
        count: usize,
        /// The limit.
        max: u32,
    },
    /// No such instance.
    #[error("instance {0} not found")]
    NotFound(InstanceId),
    /// The host is not in the providers config (any more): whatever runs there is neither
    /// read nor touched until the host is configured again or cleaned up by hand.
    #[error(
        "host {host:?} is not in the providers config (removed?); its instances there are \
         left untouched and unwatched"
    )]
    HostNotConfigured {
        /// Host.
        host: String,
    },
    /// A libvirt step failed.
    #[error("{step}: {source}")]
    Ops {
        /// The step.
        step: &'static str,
        /// What failed.
        #[source]
        source: OpsError,
    },
    /// Caching the base image failed (boxed: it carries the download's details).
    #[error(transparent)]
    Image(Box<ImageError>),
    /// A template plugin is unhealthy.
    #[error(transparent)]
    Plugin(#[from] PluginUnavailable),
    /// A template render failed.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// libvirt's own reading of a defined domain broke a plugin-output rule, so the domain
    /// was not started. Permanent: libvirt reads the same plugin output the same way again.
    #[error(
        "libvirt's reading of domain {domain:?} on host {host:?} ({origin}) failed the \
         post-define check, so it was not started: {kind}"
    )]
    DefinedRefused {
        /// Host.
        host: String,
        /// Domain.
        domain: String,
        /// Which path defined it: this Create, or an earlier one (adoption).
        origin: &'static str,
        /// The rule and the path that refused it.
        #[source]
        kind: TemplateErrorKind,
    },
    /// libvirt defined the rendered XML under another name than the operator asked for (it
    /// read `<name>` differently from the checker). That domain may be someone else's,
    /// redefined, so it is not touched.
    #[error(
        "libvirt defined the domain XML for {expected:?} on host {host:?} as domain \
         {defined:?}; left alone for an administrator to inspect"
    )]
    DefinedElsewhere {
        /// Host.
        host: String,
        /// The name the operator asked for.
        expected: String,
        /// The name libvirt defined.
        defined: String,
    },
    /// The seed ISO could not be built.
    #[error(transparent)]
    Seed(#[from] SeedError),
    /// No MAC or static address could be allocated (a full address pool is quota;
    /// boxed: it carries the listing's error).
    #[error(transparent)]
    Allocation(Box<AllocError>),
    /// The domain did not reach running in time.
    #[error("domain {domain:?} on host {host:?} is {state} after {waited:?}, not running")]
    StartTimeout {
        /// Host.
        host: String,
        /// Domain.
        domain: String,
        /// Last state seen.
        state: InstanceState,
        /// How long we waited.
        waited: Duration,
    },
    /// A blocking render task failed to run.
    #[error("render task failed: {0}")]
    Runtime(String),
    /// This replica lost the leader lease right before define or start (see
    /// [`crate::provider::Fence`]); what this Create made is removed.
    #[error("{0}")]
    LeaseLost(#[from] crate::provider::LeaseLost),
    /// Who this cluster is is not known (yet): nothing is marked or collected.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// Another cluster writes marks under this cluster's `clusterId` on this host: the
    /// host is not collected until one of the two is renamed.
    #[error(
        "host {host:?} holds {domains} domain(s) marked with this cluster's clusterId {cluster_id:?} \
         by another cluster (kube-system UID {}; ours is {ours}): two clusters share a \
         clusterId, so nothing on this host is collected until one of them sets another",
        theirs.join(", ")
    )]
    ClusterIdShared {
        /// Host.
        host: String,
        /// The shared `clusterId`.
        cluster_id: String,
        /// Our cluster UID.
        ours: String,
        /// The other clusters' UIDs.
        theirs: Vec<String>,
        /// How many of their domains are there.
        domains: usize,
    },
}

impl Classified for Kvm2Error {
    fn class(&self) -> ErrorClass {
        match self {
            Kvm2Error::InvalidRequest(_)
            | Kvm2Error::HostNotConfigured { .. }
            | Kvm2Error::Foreign { .. }
            | Kvm2Error::DefinedRefused { .. }
            | Kvm2Error::DefinedElsewhere { .. }
            | Kvm2Error::ClusterIdShared { .. } => ErrorClass::Permanent,
            Kvm2Error::Identity(e) => e.class(),
            Kvm2Error::NoCapacity(_) | Kvm2Error::HostFull { .. } => ErrorClass::Quota,
            Kvm2Error::NotFound(_) => ErrorClass::NotFound,
            Kvm2Error::Ops { source, .. } => source.class(),
            Kvm2Error::Image(e) => e.class(),
            Kvm2Error::Plugin(e) => e.class(),
            Kvm2Error::Template(e) => e.class(),
            Kvm2Error::Seed(e) => e.class(),
            Kvm2Error::Allocation(e) => e.class(),
            Kvm2Error::LeaseLost(e) => e.class(),
            Kvm2Error::StartTimeout { .. } | Kvm2Error::Runtime(_) | Kvm2Error::Unreachable(_) => {
                ErrorClass::Transient
            }
        }
    }
}

impl From<AllocError> for Kvm2Error {
    fn from(e: AllocError) -> Self {
        Kvm2Error::Allocation(Box::new(e))
    }
}

impl From<ImageError> for Kvm2Error {
    fn from(e: ImageError) -> Self {
        Kvm2Error::Image(Box::new(e))
    }
}

/// The host's address pool, parsed (config validation checked it already, so an error
/// here means a config that skipped validation).
fn address_pool(host: &HostConfig) -> Result<Option<crate::config::AddressPool>, Kvm2Error> {
    host.address_pool
        .as_ref()
        .map(|p| {
            p.parse().map_err(|(field, why)| {
                Kvm2Error::InvalidRequest(format!(
                    "host {:?} addressPool.{field}: {why}",
                    host.name
                ))
            })
        })
        .transpose()
}

/// [`Kvm2Error::DefinedRefused`]'s origin for a domain this Create defined (and removes).
const JUST_DEFINED: &str = "just defined by this Create; undefined again";
/// [`Kvm2Error::DefinedRefused`]'s origin for our domain found defined and not running.
const ADOPTED: &str = "found defined and not running; left defined";

/// Who a domain belongs to, as far as its mark tells, for [`Kvm2Error::Foreign`].
fn owner_of_mark(mark: Option<&MetadataMark>) -> String {
    match mark {
        Some(m) => format!(
            "cluster {:?}, Proxy {}/{} uid {}",
            m.cluster_id, m.namespace, m.name, m.uid
        ),
        None => "no egress-operator mark".into(),
    }
}

fn step(step: &'static str) -> impl FnOnce(OpsError) -> Kvm2Error {
    move |source| Kvm2Error::Ops { step, source }
}

/// Tunables of the provider.
#[derive(Debug, Clone)]
pub struct Kvm2Options {
    /// The image cache.
    pub images: ImageCacheOptions,
    /// How long a started domain may take to report running.
    pub start_timeout: Duration,
    /// How long a graceful shutdown may take before the domain is destroyed.
    pub shutdown_timeout: Duration,
    /// Poll interval while waiting for a state.
    pub poll_every: Duration,
    /// What the health monitor last saw of each host: placement skips unhealthy hosts
    /// instead of waiting on their timeouts. Empty (all healthy) unless a monitor writes it.
    pub health: HealthBoard,
    /// Where the mark's `createdAt` comes from (the system clock; tests move it).
    pub clock: StampClock,
    /// What other clusters leave on the hosts (unregistered unless the registry sets it).
    pub sharing: super::sharing::SharingMetrics,
    /// The domain index's counters (unregistered unless the registry sets them).
    pub index: super::index::IndexMetrics,
}

/// The wall clock that stamps a domain's mark at define time; replaceable so a test can
/// model a download that takes longer than the GC's grace period without waiting for it.
#[derive(Clone)]
pub struct StampClock(Arc<dyn Fn() -> std::time::SystemTime + Send + Sync>);

impl StampClock {
    /// A clock that reads `now`.
    pub fn new(now: impl Fn() -> std::time::SystemTime + Send + Sync + 'static) -> Self {
        Self(Arc::new(now))
    }

    /// Now, as RFC 3339 in whole seconds (what the mark carries).
    pub fn rfc3339(&self) -> String {
        humantime::format_rfc3339_seconds((self.0)()).to_string()
    }
}

impl Default for StampClock {
    fn default() -> Self {
        Self::new(std::time::SystemTime::now)
    }
}

impl std::fmt::Debug for StampClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StampClock")
    }
}

impl Default for Kvm2Options {
    fn default() -> Self {
        Self {
            images: ImageCacheOptions::default(),
            start_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(30),
            poll_every: Duration::from_millis(250),
            health: HealthBoard::default(),
            clock: StampClock::default(),
            sharing: Default::default(),
            index: Default::default(),
        }
    }
}

/// An upload heartbeat record as last read, and since when it has not changed.
type HeartbeatSeen = (Option<Vec<u8>>, tokio::time::Instant);

/// The kvm2 provider.
pub struct Kvm2Provider {
    /// The config and plugins in force: a reload replaces them while the provider runs
    /// (the hosts' connections and create slots stay as made at start).
    live: Arc<crate::config::live::Live>,
    ops: Arc<dyn HostOps>,
    images: ImageCache,
    names: KeyedLocks,
    creates: BTreeMap<String, Arc<Semaphore>>,
    /// Creates in flight per host that have passed the room check: they count against
    /// `maxDomains` before their domain exists.
    reserved: Arc<std::sync::Mutex<BTreeMap<String, usize>>>,
    /// MACs and static addresses: per-host allocation, the MAC census, and the index of
    /// what each host holds of ours (so a Create or Delete does not list whole hosts).
    book: AddressBook,
    options: Kvm2Options,
    /// Image upload heartbeats the garbage collector saw, by host and volume name: the
    /// record and since when it has not changed (see [`Kvm2Provider::upload_alive`]).
    beats: std::sync::Mutex<BTreeMap<(String, String), HeartbeatSeen>>,
    /// The networks of DHCP-mode hosts' bridges, as libvirt declares them.
    bridge_nets: super::bridgenet::BridgeNets,
    /// This cluster's announcements of the images it uses on shared hosts, and its view
    /// of the other clusters'.
    uses: crate::provider::kvm2::image::uses::ImageUses,
}

/// A slot on a host held by a Create in flight; released on drop.
struct Reservation {
    host: String,
    table: Arc<std::sync::Mutex<BTreeMap<String, usize>>>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut t = match self.table.lock() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        };
        if let Some(n) = t.get_mut(&self.host) {
            *n = n.saturating_sub(1);
        }
    }
}

impl std::fmt::Debug for Kvm2Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kvm2Provider")
            .field("hosts", &self.creates.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Creates made for one request, so a failure removes exactly those.
///
/// Also the record of a Create that never finished: a Create whose future is dropped
/// (the leader fence cancels it after the lease was lost, and no libvirt call may follow)
/// cannot clean up, so on drop before [`Made::settle`] it logs what it made, and what the
/// step in flight may have made, by name. Those carry our mark and the Proxy's UID: the
/// new leader's Create adopts or replaces them and the collector takes leftover volumes
/// after its grace period; the log line names them for whoever looks sooner.
#[derive(Default)]
struct Made {
    root: bool,
    seed: bool,
    domain: bool,
    /// Host, domain, root and seed volume names: set when the Create starts making things.
    names: Option<(String, String, String, String)>,
    settled: bool,
}

impl Made {
    fn for_create(host: &str, identity: &InstanceIdentity) -> Self {
        Self {
            names: Some((
                host.to_string(),
                identity.domain_name.clone(),
                identity.root_volume.clone(),
                identity.seed_volume.clone(),
            )),
            ..Self::default()
        }
    }

    /// The Create ended (made its instance, or cleaned up after a failure).
    fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let Some((host, domain, root, seed)) = &self.names else {
            return;
        };
        let made: Vec<&str> = [
            (self.root, root.as_str()),
            (self.seed, seed.as_str()),
            (self.domain, domain.as_str()),
        ]
        .iter()
        .filter(|(m, _)| *m)
        .map(|(_, n)| *n)
        .collect();
        tracing::warn!(host = %host, domain = %domain, made = ?made,
            may_exist = ?[root.as_str(), seed.as_str(), domain.as_str()],
            "create cancelled before it ended; what it made is left for the next Create or the collector");
    }
}

impl Kvm2Provider {
    /// A provider over `ops` for the hosts of `config`, rendering with `templates`.
    pub fn new(
        config: Arc<ValidConfig>,
        ops: Arc<dyn HostOps>,
        templates: Arc<TemplateSet>,
        options: Kvm2Options,
        image_metrics: ImageMetrics,
    ) -> Self {
        let live = Arc::new(crate::config::live::Live::new(config, templates));
        Self::with_live(live, ops, options, image_metrics)
    }

    /// A provider over `ops` for the hosts of the config in `live`, which a reload may
    /// replace.
    pub fn with_live(
        live: Arc<crate::config::live::Live>,
        ops: Arc<dyn HostOps>,
        options: Kvm2Options,
        image_metrics: ImageMetrics,
    ) -> Self {
        let config = live.config();
        let creates = config
            .kvm2
            .hosts
            .iter()
            .map(|h| {
                let permits = usize::try_from(h.max_concurrent_creates.max(1)).unwrap_or(1);
                (h.name.clone(), Arc::new(Semaphore::new(permits)))
            })
            .collect();
        let uses = crate::provider::kvm2::image::uses::ImageUses::new(
            config
                .kvm2
                .images
                .iter()
                .map(|i| crate::instance::image_digest(&i.sha256))
                .collect(),
            options.images.stale_after,
        );
        Self {
            images: ImageCache::new(ops.clone(), options.images.clone(), image_metrics),
            live,
            ops,
            names: KeyedLocks::new(),
            creates,
            reserved: Arc::default(),
            book: AddressBook::with_index(DomainIndex::new(options.index.clone())),
            options,
            beats: Default::default(),
            bridge_nets: Default::default(),
            uses,
        }
    }

    /// The domain index (its metrics are read by tests).
    pub fn index(&self) -> &DomainIndex {
        self.book.index()
    }

    /// What other clusters leave on the hosts (its metrics are read by tests).
    pub fn sharing(&self) -> &super::sharing::SharingMetrics {
        &self.options.sharing
    }

    /// The image cache (its metrics are read by tests).
    pub fn image_cache(&self) -> &ImageCache {
        &self.images
    }

    /// The host operations underneath (the CLI reads the domain XML through them).
    pub fn ops(&self) -> &Arc<dyn HostOps> {
        &self.ops
    }

    /// The config in force now (take it once per step).
    fn config(&self) -> Arc<ValidConfig> {
        self.live.config()
    }

    fn host(&self, name: &str) -> Result<HostConfig, Kvm2Error> {
        self.config()
            .host(name)
            .cloned()
            .ok_or_else(|| Kvm2Error::HostNotConfigured { host: name.into() })
    }

    /// This cluster's identity; an error until it is known (nothing is written before).
    /// Every config a reload installs shares the identity resolved at start.
    fn me(&self) -> Result<Resolved, Kvm2Error> {
        self.config()
            .identity()
            .get()
            .cloned()
            .map_err(Kvm2Error::Identity)
    }

    /// Whether a mark is this cluster's. Nothing is ours while the identity is unknown,
    /// and a twin's mark (our `clusterId`, another cluster's UID) never is.
    fn is_ours(&self, mark: &MetadataMark) -> bool {
        self.me().is_ok_and(|me| {
            me.judge(&mark.cluster_id, mark.cluster_uid.as_deref()) == Ownership::Ours
        })
    }

    /// Refuses a host whose domains include a twin's: two clusters under one `clusterId`
    /// cannot tell whose images and leftovers are whose, so the host is not collected,
    /// and the sighting is counted and reported until one of them is renamed.
    /// Unknown identity is an error too: a listing that cannot judge ownership is
    /// "unknown", never "none of ours".
    fn refuse_twins(&self, host: &str, domains: &[DomainRecord]) -> Result<(), Kvm2Error> {
        let me = self.me()?;
        let twins: Vec<&MetadataMark> = domains
            .iter()
            .filter_map(|d| d.mark.as_ref())
            .filter(|m| me.judge(&m.cluster_id, m.cluster_uid.as_deref()) == Ownership::Twin)
            .collect();
        let count = twins.len();
        self.options.sharing.observe_twins(host, count);
        if count == 0 {
            return Ok(());
        }
        let theirs: BTreeSet<&str> = twins
            .iter()
            .filter_map(|m| m.cluster_uid.as_deref())
            .collect();
        Err(Kvm2Error::ClusterIdShared {
            host: host.to_string(),
            cluster_id: me.id.clone(),
            ours: me.uid.clone().unwrap_or_default(),
            theirs: theirs.into_iter().map(str::to_string).collect(),
            domains: count,
        })
    }

    fn instance(&self, host: &str, rec: &DomainRecord, mark: &MetadataMark) -> Instance {
        Instance {
            id: InstanceId {
                host: host.to_string(),
                name: rec.name.clone(),
            },
            proxy: ProxyRef {
                namespace: mark.namespace.clone(),
                name: mark.name.clone(),
                uid: mark.uid.clone(),
            },
            state: rec.state,
            addresses: Vec::new(),
            address_source: None,
            seed_applied: None,
            created_at: mark.created_at.clone(),
        }
    }

    /// Picks the host: the pinned one, the one already holding this domain, or the
    /// reachable host with the fewest of our domains that still has room.
    ///
    /// Healthy hosts are ranked on the domain index (checked within
    /// [`index::RECENT`]), and the winner is checked again now before it is chosen.
    /// Hosts the health board marks unhealthy are not looked at (a dead host would hold the
    /// Create for its whole call deadline). They are only asked, concurrently with the
    /// listings and without waiting for them, whether they hold this domain: a host
    /// marked unhealthy that still answers keeps its domain (adopted, not duplicated).
    /// A pinned host is used whatever the board says: the user chose it.
    async fn place(&self, req: &CreateRequest, domain: &str) -> Result<String, Kvm2Error> {
        let board = &self.options.health;
        if let Some(h) = &req.spec.host {
            self.host(h)?;
            if let Some(last) = board.get(h).filter(|t| !t.reachable) {
                tracing::warn!(host = %h, reason = last.reason.as_deref().unwrap_or("unknown"),
                    "pinned host is marked unhealthy; using it anyway");
            }
            return Ok(h.clone());
        }
        let config = self.config();
        let (healthy, unhealthy): (Vec<&HostConfig>, Vec<&HostConfig>) = config
            .kvm2
            .hosts
            .iter()
            .partition(|h| !board.is_unhealthy(&h.name));
        let mut skipped = Vec::new();
        for host in &unhealthy {
            let reason = board
                .get(&host.name)
                .and_then(|t| t.reason)
                .unwrap_or_else(|| "unknown".into());
            tracing::debug!(host = %host.name, %reason, "unhealthy host skipped in placement");
            skipped.push(format!("{}: unhealthy ({reason})", host.name));
        }

        let mut probes: FuturesUnordered<_> = unhealthy
            .iter()
            .map(|host| async move {
                (
                    host.name.as_str(),
                    self.ops.domain(&host.name, domain).await,
                )
            })
            .collect();
        let listings = futures_util::future::join_all(healthy.iter().map(|host| async move {
            let found = self
                .index()
                .domains(self.ops.as_ref(), &host.name, Fresh::Within(index::RECENT))
                .await;
            (*host, found)
        }));
        let mut listings = std::pin::pin!(listings);
        let mut held_by_unhealthy: Option<String> = None;
        let mut note = |(host, found): (&str, Result<Option<DomainRecord>, OpsError>)| {
            if matches!(found, Ok(Some(_))) && held_by_unhealthy.is_none() {
                held_by_unhealthy = Some(host.to_string());
            }
        };
        let listed = loop {
            tokio::select! {
                biased;
                Some(probe) = probes.next(), if !probes.is_empty() => note(probe),
                listed = &mut listings => break listed,
            }
        };
        // Probes that have answered by now count; the rest are dropped, not waited for.
        while let Some(Some(probe)) = probes.next().now_or_never() {
            note(probe);
        }
        drop(probes);

        // Ranked on the index (checked within the last few seconds), then the winner is
        // checked now: one names-only listing, which also proves the host answers (a
        // recent index says nothing of that) and that it still has room.
        let mut candidates: Vec<(usize, usize, &HostConfig)> = Vec::new();
        let mut failures = Vec::new();
        for (order, (host, result)) in listed.into_iter().enumerate() {
            match result {
                Ok(list) => {
                    if list.iter().any(|d| d.name == domain) {
                        return Ok(host.name.clone());
                    }
                    let ours = self.ours_on(host, &list);
                    if u32::try_from(ours).unwrap_or(u32::MAX) < host.max_domains {
                        candidates.push((ours, order, host));
                    }
                }
                Err(e) => {
                    tracing::warn!(host = %host.name, error = %e, "host skipped in placement");
                    failures.push(format!("{}: {}", host.name, e.class()));
                }
            }
        }
        if let Some(h) = held_by_unhealthy {
            tracing::info!(host = %h, domain, "host is marked unhealthy but holds this domain");
            return Ok(h);
        }
        candidates.sort_by_key(|(ours, order, _)| (*ours, *order));
        let mut best: Option<(usize, String)> = None;
        for (_, _, host) in candidates {
            match self
                .index()
                .domains(self.ops.as_ref(), &host.name, Fresh::Now)
                .await
            {
                Ok(list) => {
                    if list.iter().any(|d| d.name == domain) {
                        return Ok(host.name.clone());
                    }
                    let ours = self.ours_on(host, &list);
                    if u32::try_from(ours).unwrap_or(u32::MAX) < host.max_domains {
                        best = Some((ours, host.name.clone()));
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(host = %host.name, error = %e, "host skipped in placement");
                    failures.push(format!("{}: {}", host.name, e.class()));
                }
            }
        }
        match best {
            Some((_, h)) => Ok(h),
            // Health changes every round: a host skipped as unhealthy may have room soon.
            None if failures.len() == healthy.len() || !skipped.is_empty() => {
                let mut why = skipped;
                why.extend(failures);
                if why.len() < self.config().kvm2.hosts.len() {
                    why.push("every other host is at maxDomains".into());
                }
                Err(Kvm2Error::Unreachable(why.join(", ")))
            }
            None => Err(Kvm2Error::NoCapacity(format!(
                "every reachable host is at maxDomains (unreachable: {})",
                if failures.is_empty() {
                    "none".to_string()
                } else {
                    failures.join(", ")
                }
            ))),
        }
    }

    /// Refuses bad per-Proxy plugin settings before anything is placed, downloaded or
    /// made (a render would refuse them too, but only after the image and volumes).
    /// Both plugins must be loaded, and a Proxy's overrides acceptable to them, before a
    /// Create places, downloads or makes anything: a Create while the plugins still load
    /// (or after they failed) fails at once with their reason, instead of after an image
    /// upload and a root volume it then has to remove.
    async fn check_overrides(&self, req: &CreateRequest) -> Result<(), Kvm2Error> {
        let overrides = req.spec.template_settings.clone();
        self.render_blocking(move |t| {
            let (vendor_data, domain) = (t.vendor_data()?, t.domain()?);
            if let Some(o) = overrides {
                vendor_data.check_overrides(o.vendor_data.as_ref())?;
                domain.check_overrides(o.domain.as_ref())?;
            }
            Ok(())
        })
        .await
    }

    /// Our domains in `list` plus the Creates in flight on `host`: what counts against
    /// its `maxDomains`.
    fn ours_on(&self, host: &HostConfig, list: &[DomainRecord]) -> usize {
        list.iter()
            .filter(|d| d.mark.as_ref().is_some_and(|m| self.is_ours(m)))
            .count()
            + self.in_flight(&host.name)
    }

    fn in_flight(&self, host: &str) -> usize {
        match self.reserved.lock() {
            Ok(t) => t.get(host).copied().unwrap_or(0),
            Err(p) => p.into_inner().get(host).copied().unwrap_or(0),
        }
    }

    async fn render_blocking<T, F>(&self, f: F) -> Result<T, Kvm2Error>
    where
        T: Send + 'static,
        F: FnOnce(&TemplateSet) -> Result<T, Kvm2Error> + Send + 'static,
    {
        let templates = self.live.templates();
        tokio::task::spawn_blocking(move || f(&templates))
            .await
            .map_err(|e| Kvm2Error::Runtime(e.to_string()))?
    }

    async fn create_inner(&self, req: &CreateRequest) -> Result<Instance, Kvm2Error> {
        let mut problems = Problems::default();
        req.spec.check(&self.config(), &mut problems);
        if !problems.is_empty() {
            let all: Vec<String> = problems.into_vec().iter().map(|p| p.to_string()).collect();
            return Err(Kvm2Error::InvalidRequest(all.join("; ")));
        }
        let identity =
            InstanceIdentity::for_uid(&req.proxy.uid).map_err(Kvm2Error::InvalidRequest)?;
        self.check_overrides(req).await?;
        let _name_lock = self.names.lock(&identity.domain_name).await;
        let host_name = self.place(req, &identity.domain_name).await?;
        let host = self.host(&host_name)?;
        let h = host.name.as_str();
        let pool = host.storage_pool.as_str();

        if let Some(rec) = self
            .ops
            .domain(h, &identity.domain_name)
            .await
            .map_err(step("domain lookup"))?
        {
            match rec.mark.clone() {
                Some(m) if self.is_ours(&m) && m.uid == req.proxy.uid => {
                    if self.adoptable(&host, &identity).await? {
                        if rec.state != InstanceState::Running {
                            self.check_adopted(req, &host, &identity, &m).await?;
                        }
                        tracing::info!(host = h, domain = %identity.domain_name, state = %rec.state, "adopting our existing domain");
                        req.fence.check("domain start")?;
                        match self.finish_start(&host, &identity, rec, m).await {
                            // Adoption rule: a domain that stays paused or suspended
                            // through a resume or wake and the whole start timeout (a
                            // guest paused on an I/O error pauses again at once) is
                            // replaced, disk and seed included, since the proxy keeps no
                            // state worth the wait; anything else is reported as is.
                            Err(Kvm2Error::StartTimeout {
                                state: state @ (InstanceState::Paused | InstanceState::Suspended),
                                ..
                            }) => {
                                tracing::warn!(host = h, domain = %identity.domain_name, %state,
                                    "adopted domain did not resume; replacing it");
                                self.remove_domain(h, &identity.domain_name).await?;
                                for name in [&identity.seed_volume, &identity.root_volume] {
                                    self.ops
                                        .delete_volume(h, pool, name)
                                        .await
                                        .map_err(step("volume delete"))?;
                                }
                            }
                            other => return other,
                        }
                    } else {
                        tracing::warn!(host = h, domain = %identity.domain_name,
                            "our domain lost its volumes; replacing it");
                        self.remove_domain(h, &identity.domain_name).await?;
                    }
                }
                other => {
                    return Err(Kvm2Error::Foreign {
                        host: h.into(),
                        domain: identity.domain_name.clone(),
                        owner: match &other {
                            Some(m) => format!(
                                "cluster {:?}, Proxy {}/{} uid {}",
                                m.cluster_id, m.namespace, m.name, m.uid
                            ),
                            None => "no egress-operator mark".into(),
                        },
                    });
                }
            }
        }

        let permits = self.creates.get(h).cloned();
        let _create_permit = match &permits {
            Some(p) => Some(
                p.clone()
                    .acquire_owned()
                    .await
                    .map_err(|e| Kvm2Error::Runtime(e.to_string()))?,
            ),
            None => None,
        };
        let _slot = self.reserve(&host).await?;

        let mut made = Made::for_create(h, &identity);
        match self.build(req, &host, &identity, &mut made).await {
            Ok(instance) => {
                made.settle();
                Ok(instance)
            }
            Err(e) => {
                tracing::warn!(host = h, domain = %identity.domain_name, class = %e.class(), error = %e,
                    "create failed; removing what it made");
                self.cleanup(h, pool, &identity, &made).await;
                made.settle();
                Err(e)
            }
        }
    }

    /// Whether our existing domain still has its root volume (else it cannot boot).
    async fn adoptable(
        &self,
        host: &HostConfig,
        identity: &InstanceIdentity,
    ) -> Result<bool, Kvm2Error> {
        Ok(self
            .ops
            .volume(&host.name, &host.storage_pool, &identity.root_volume)
            .await
            .map_err(step("root volume lookup"))?
            .is_some())
    }

    /// Runs the post-define check on libvirt's reading of our domain before an adopting
    /// Create starts it: a crash between the define and its check (or an operator version
    /// without the check) leaves a defined domain nobody checked. The input is this Proxy's
    /// on this host with the mark the domain carries (the Proxy's name and creation time
    /// when it was rendered). A domain that fails is not started and is left defined: its
    /// mark says it is this Proxy's, and this Create did not make it.
    async fn check_adopted(
        &self,
        req: &CreateRequest,
        host: &HostConfig,
        identity: &InstanceIdentity,
        mark: &MetadataMark,
    ) -> Result<(), Kvm2Error> {
        let h = host.name.as_str();
        let mut facts = self.ops.facts(h).await.map_err(step("host facts"))?;
        facts.kvm &= !host.disable_kvm;
        let owner = ProxyRef {
            namespace: mark.namespace.clone(),
            name: mark.name.clone(),
            uid: req.proxy.uid.clone(),
        };
        // The MAC and address the mark records: what the domain was rendered with.
        let mut inputs = crate::render::inputs_with(
            &self.config(),
            &owner,
            &req.spec,
            Some(h),
            &facts,
            &mark.created_at,
            &mark.net(),
        )
        .map_err(Kvm2Error::InvalidRequest)?;
        // The mark exactly as recorded: one written before MACs were recorded has none.
        inputs.domain.metadata_mark = mark.to_xml();
        let xml = self
            .ops
            .inactive_xml(h, &identity.domain_name)
            .await
            .map_err(step("domain inactive xml"))?
            .ok_or_else(|| {
                Kvm2Error::NotFound(InstanceId {
                    host: h.into(),
                    name: identity.domain_name.clone(),
                })
            })?;
        self.check_defined(h, &identity.domain_name, xml, inputs.domain, ADOPTED)
            .await
    }

    /// Checks libvirt's reading of a defined domain (its inactive XML) with the same
    /// rules as the plugin's output, off the async threads like a render.
    async fn check_defined(
        &self,
        host: &str,
        domain: &str,
        xml: String,
        input: DomainInput,
        origin: &'static str,
    ) -> Result<(), Kvm2Error> {
        // The host's policy (bridge MTU, CPU placement, NVRAM templates); a host no longer
        // configured gets the strictest.
        let policy = self
            .config()
            .host(host)
            .map(|h| HostPolicy::for_render(h, &input))
            .unwrap_or_default();
        let verdict =
            tokio::task::spawn_blocking(move || check_defined_domain_xml_on(&xml, &input, &policy))
                .await
                .map_err(|e| Kvm2Error::Runtime(e.to_string()))?;
        verdict.map_err(|kind| {
            tracing::warn!(host, domain, origin, reason = %kind,
                "libvirt's reading of the defined domain failed the post-define check; not starting it");
            Kvm2Error::DefinedRefused {
                host: host.into(),
                domain: domain.into(),
                origin,
                kind,
            }
        })
    }

    /// Takes a slot on `host` if its domains plus the Creates in flight stay within
    /// `maxDomains`; the slot is held until the returned guard drops.
    async fn reserve(&self, host: &HostConfig) -> Result<Reservation, Kvm2Error> {
        let list = self
            .index()
            .domains(self.ops.as_ref(), &host.name, Fresh::Within(index::RECENT))
            .await
            .map_err(step("domain list"))?;
        self.book.census().note(&host.name, &list);
        let defined = list
            .iter()
            .filter(|d| d.mark.as_ref().is_some_and(|m| self.is_ours(m)))
            .count();
        let mut table = match self.reserved.lock() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        };
        let in_flight = table.entry(host.name.clone()).or_insert(0);
        let count = defined + *in_flight;
        if u32::try_from(count).unwrap_or(u32::MAX) >= host.max_domains {
            return Err(Kvm2Error::HostFull {
                host: host.name.clone(),
                count,
                max: host.max_domains,
            });
        }
        *in_flight += 1;
        Ok(Reservation {
            host: host.name.clone(),
            table: self.reserved.clone(),
        })
    }

    async fn build(
        &self,
        req: &CreateRequest,
        host: &HostConfig,
        identity: &InstanceIdentity,
        made: &mut Made,
    ) -> Result<Instance, Kvm2Error> {
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        // The network identity first: a full address pool fails the Create before an image
        // is downloaded. The claim is held until this Create ends; by then the domain's
        // mark records the identity (or the Create failed and nothing uses it).
        let address_pool = address_pool(host)?;
        let allocation = self
            .book
            .allocate(
                self.ops.as_ref(),
                h,
                &identity.uid,
                address_pool.as_ref(),
                fresh_incarnation(),
            )
            .await?;
        let net = allocation.net.clone();
        let mut facts = self.ops.facts(h).await.map_err(step("host facts"))?;
        facts.kvm &= !host.disable_kvm;
        // Provisional: the mark that is defined is stamped again right before the define.
        let created_at = self.options.clock.rfc3339();
        let inputs = crate::render::inputs_with(
            &self.config(),
            &req.proxy,
            &req.spec,
            Some(h),
            &facts,
            &created_at,
            &net,
        )
        .map_err(Kvm2Error::InvalidRequest)?;

        // Base image, then the overlay over it. Announced once the base is sure, so that
        // a cluster sharing the host does not collect it under the overlay to come.
        let base = self.images.ensure(host, &inputs.image).await?;
        self.uses
            .announce(&self.me()?, self.ops.as_ref(), h, pool)
            .await
            .map_err(step("image announcement"))?;
        let base_info = self
            .ops
            .volume(h, pool, &base.volume)
            .await
            .map_err(step("base volume lookup"))?
            .ok_or_else(|| {
                Kvm2Error::Unreachable(format!(
                    "base volume {} vanished from pool {pool} on {h} after it was verified",
                    base.volume
                ))
            })?;
        // At least the image's virtual size; a machine type asking for less is refused.
        let capacity = crate::provider::kvm2::image::overlay_capacity(
            &inputs.image,
            &inputs.machine_type.name,
            &base,
            inputs.machine_type.disk_gib.saturating_mul(1 << 30),
            base_info.capacity,
        )
        .map_err(ImageError::from)?;
        let overlay = volume::overlay_volume_xml(
            &identity.root_volume,
            capacity,
            &base_info.path,
            base.format,
        );
        // A new incarnation always boots a fresh root disk. A root volume already there
        // (a replacement that removed the domain but not its volume, a Create that died
        // after this step) may have booted: cloud-init would find the same instance-id on
        // it and keep its old network config, so the new MAC or static address would never
        // be configured. No domain uses it (we hold the name's lock and none is defined),
        // so it is deleted and made again.
        let root = &identity.root_volume;
        if self
            .ops
            .create_volume(h, pool, root, overlay.clone())
            .await
            .map_err(step("root volume create"))?
            == Created::Exists
        {
            tracing::info!(host = h, volume = %root, "an earlier incarnation's root volume is replaced by a fresh one");
            self.ops
                .delete_volume(h, pool, root)
                .await
                .map_err(step("stale root volume delete"))?;
            if self
                .ops
                .create_volume(h, pool, root, overlay)
                .await
                .map_err(step("root volume create"))?
                == Created::Exists
            {
                return Err(Kvm2Error::Unreachable(format!(
                    "root volume {root} in pool {pool} on {h} came back while it was replaced"
                )));
            }
        }
        made.root = true;

        // Seed ISO: vendor-data from the plugin, user-data from the request.
        let vendor_input = inputs.vendor_data.clone();
        let vendor_overrides = inputs.overrides.vendor_data.clone();
        let vendor_data = self
            .render_blocking(move |t| {
                Ok(t.vendor_data()?
                    .render_with(&vendor_input, vendor_overrides.as_ref())?)
            })
            .await?;
        let network_config = match (net.address, &address_pool) {
            (Some(address), Some(p)) => Some(
                seed::network_config(&StaticNet {
                    mac: net.mac.clone(),
                    address,
                    prefix: p.net.prefix_len(),
                    gateway: p.gateway,
                    dns: p.dns.clone(),
                })?
                .into_bytes(),
            ),
            _ => None,
        };
        let files = SeedFiles {
            meta_data: seed::meta_data(&identity.uid, &req.proxy.name),
            user_data: req.user_data.as_ref().map(|u| u.expose().to_vec()),
            vendor_data: vendor_data.into_bytes(),
            network_config,
        };
        let iso = tokio::task::spawn_blocking(move || seed::build(&files))
            .await
            .map_err(|e| Kvm2Error::Runtime(e.to_string()))??;
        made.seed = true;
        volume::put_seed(self.ops.as_ref(), h, pool, &identity.seed_volume, iso)
            .await
            .map_err(step("seed volume"))?;

        // Domain: render, define (libvirt validates against its schema), then check
        // libvirt's own reading of what it defined before anything starts it.
        // The mark's createdAt is stamped here, right before the define, not when the
        // Create began: the GC's grace period counts from it, and the image download
        // before this point may take longer than the whole grace period.
        let mut stamped = inputs.domain.clone();
        let me = self.me()?;
        stamped.metadata_mark = MetadataMark {
            cluster_id: me.id.clone(),
            cluster_uid: me.uid.clone(),
            namespace: req.proxy.namespace.clone(),
            name: req.proxy.name.clone(),
            uid: req.proxy.uid.clone(),
            created_at: self.options.clock.rfc3339(),
            mac: Some(net.mac.clone()),
            address: net.address,
        }
        .to_xml();
        let domain_input = stamped.clone();
        let domain_overrides = inputs.overrides.domain.clone();
        let policy = HostPolicy::for_render(&inputs.host, &stamped);
        let xml = self
            .render_blocking(move |t| {
                Ok(t.domain()?
                    .render_on(&domain_input, domain_overrides.as_ref(), &policy)?)
            })
            .await?;
        req.fence.check("domain define")?;
        // Until the define is read back and recorded, other Creates' checks of the host
        // leave this name to us (the allocation's claim holds its MAC and address).
        let _defining = self.index().defining(h, &identity.domain_name);
        let defined = self
            .ops
            .define(h, xml)
            .await
            .map_err(step("domain define"))?;
        if defined.name != identity.domain_name {
            tracing::error!(host = h, expected = %identity.domain_name, defined = %defined.name,
                "libvirt defined the rendered domain under another name");
            return Err(Kvm2Error::DefinedElsewhere {
                host: h.into(),
                expected: identity.domain_name.clone(),
                defined: defined.name,
            });
        }
        made.domain = true;
        self.check_defined(
            h,
            &identity.domain_name,
            defined.inactive_xml,
            stamped,
            JUST_DEFINED,
        )
        .await?;
        let rec = self
            .ops
            .domain(h, &identity.domain_name)
            .await
            .map_err(step("domain lookup"))?
            .ok_or_else(|| {
                Kvm2Error::NotFound(InstanceId {
                    host: h.into(),
                    name: identity.domain_name.clone(),
                })
            })?;
        self.index().defined(h, rec.clone());
        let mark = rec.mark.clone().ok_or_else(|| {
            Kvm2Error::InvalidRequest(
                "the domain plugin's XML dropped the operator's metadata mark".into(),
            )
        })?;
        req.fence.check("domain start")?;
        let started = self.finish_start(host, identity, rec, mark).await;
        drop(allocation);
        started
    }

    /// Brings the domain to running, waits (bounded by the start timeout) and reports it.
    ///
    /// The rule, by the state seen at each look:
    /// - running, or blocked (running, its vCPUs waiting on a resource): done;
    /// - paused: resumed; suspended (guest power management): woken;
    /// - shut off or crashed: started;
    /// - being shut down, or no state: waited for (then started once it is off).
    ///
    /// One that is not running when the time is up is [`Kvm2Error::StartTimeout`] with
    /// the state last seen; an adopting Create replaces a paused or suspended one.
    async fn finish_start(
        &self,
        host: &HostConfig,
        identity: &InstanceIdentity,
        rec: DomainRecord,
        mark: MetadataMark,
    ) -> Result<Instance, Kvm2Error> {
        let h = host.name.as_str();
        let started = Instant::now();
        let mut last = rec.state;
        let mut acted_on: Option<InstanceState> = None;
        loop {
            // One action per state entered: a resume that does not take is not repeated
            // every poll, but a domain that is paused again later is resumed again.
            if acted_on != Some(last) {
                match last {
                    InstanceState::Paused | InstanceState::Suspended => {
                        tracing::info!(host = h, domain = %identity.domain_name, state = %last, "waking the domain");
                        self.ops
                            .wake(h, &identity.domain_name)
                            .await
                            .map_err(step("domain wake"))?;
                    }
                    InstanceState::ShutOff | InstanceState::Crashed => {
                        self.ops
                            .start(h, &identity.domain_name)
                            .await
                            .map_err(step("domain start"))?;
                    }
                    InstanceState::Running
                    | InstanceState::Blocked
                    | InstanceState::Dying
                    | InstanceState::NoState => {}
                }
                acted_on = Some(last);
            }
            let now = self
                .ops
                .domain(h, &identity.domain_name)
                .await
                .map_err(step("domain state"))?
                .ok_or_else(|| {
                    Kvm2Error::NotFound(InstanceId {
                        host: h.into(),
                        name: identity.domain_name.clone(),
                    })
                })?;
            last = now.state;
            if matches!(last, InstanceState::Running | InstanceState::Blocked) {
                let mut inst = self.instance(h, &now, &mark);
                self.report(host, &mark, &mut inst).await;
                return Ok(inst);
            }
            if started.elapsed() >= self.options.start_timeout {
                break;
            }
            tokio::time::sleep(self.options.poll_every).await;
        }
        Err(Kvm2Error::StartTimeout {
            host: h.into(),
            domain: identity.domain_name.clone(),
            state: last,
            waited: started.elapsed(),
        })
    }

    /// Fills in what a running instance reports beyond its state: its addresses and their
    /// source, and whether the guest applied its seed. Best effort: a report, not a
    /// condition of success.
    ///
    /// A static address (recorded in the mark) is reported as it is, without asking any
    /// source. Otherwise the sources are asked in [`AddressSource::ORDER`] for the mark's
    /// MAC, under the rules of [`addresses`]. Then the guest agent is asked for the host
    /// name, unless it already failed to answer in this call.
    async fn report(&self, host: &HostConfig, mark: &MetadataMark, inst: &mut Instance) {
        let (h, name) = (host.name.as_str(), inst.id.name.clone());
        let mut agent_answered = true;
        if let Some(address) = mark.address {
            inst.addresses = vec![std::net::IpAddr::V4(address)];
            inst.address_source = Some(AddressOrigin::Static);
        } else {
            let mac = mark.mac_or_legacy();
            let configured = host
                .bridge_network
                .as_deref()
                .and_then(|n| crate::config::types::bridge_network(n).ok());
            let net = match (address_pool(host).ok().flatten(), configured) {
                (Some(p), _) => Some(p.net),
                (None, Some(net)) => Some(net),
                (None, None) => self.bridge_net(host).await,
            };
            let (found, source, agent) = self.detect(h, &name, &mac, net.as_ref()).await;
            agent_answered = agent;
            if !found.is_empty() && self.mac_shared(h, &mac, &name).await {
                tracing::warn!(host = h, domain = %name, %mac,
                    "another domain on the host carries this MAC; its addresses are not published");
            } else {
                inst.address_source = source.filter(|_| !found.is_empty());
                inst.addresses = found;
            }
        }
        if agent_answered {
            inst.seed_applied = self.seed_applied(h, &name, &mark.name).await;
        }
    }

    /// The network a DHCP-mode host's bridge serves ([`super::bridgenet`]), read at most
    /// once per [`super::bridgenet::BRIDGE_NET_TTL`]; `None` when libvirt declares none or
    /// the lookup failed (then every address is kept, as when nothing is known).
    async fn bridge_net(&self, host: &HostConfig) -> Option<ipnet::Ipv4Net> {
        if let Some(net) = self.bridge_nets.fresh(&host.name) {
            return net;
        }
        match self.ops.bridge_network(&host.name, &host.bridge).await {
            Ok(net) => {
                self.bridge_nets.note(&host.name, net);
                net
            }
            Err(e) => {
                tracing::debug!(host = %host.name, bridge = %host.bridge, error = %e,
                    "the bridge's network could not be read; addresses are not checked against it");
                None
            }
        }
    }

    /// The first source (in [`AddressSource::ORDER`]) with a usable address of `mac`
    /// inside `net` (when known), and whether the guest agent answered at all.
    async fn detect(
        &self,
        host: &str,
        name: &str,
        mac: &str,
        net: Option<&ipnet::Ipv4Net>,
    ) -> (Vec<std::net::IpAddr>, Option<AddressOrigin>, bool) {
        let mut agent_answered = false;
        for source in AddressSource::ORDER {
            match self.ops.addresses(host, name, source).await {
                Ok(nics) => {
                    // A running agent always reports at least the guest's loopback.
                    agent_answered |= source == AddressSource::Agent && !nics.is_empty();
                    let picked = addresses::within(
                        net,
                        addresses::pick_addresses(Some(mac), &[(source, nics)]),
                    );
                    if !picked.is_empty() {
                        return (picked, Some(source.origin()), agent_answered);
                    }
                }
                Err(e) => {
                    tracing::debug!(host, domain = name, ?source, error = %e, "address source failed");
                }
            }
        }
        (Vec::new(), None, agent_answered)
    }

    /// Whether another domain on `host` carries `mac`, by the census (listing the host
    /// when the census is missing or old). A listing that fails counts as "no": the
    /// Create-time check screened the MAC already.
    async fn mac_shared(&self, host: &str, mac: &str, name: &str) -> bool {
        if let Some(shared) = self.book.census().shared(host, mac, name) {
            return shared;
        }
        match self
            .index()
            .domains(self.ops.as_ref(), host, Fresh::Within(index::RECENT))
            .await
        {
            Ok(list) => {
                self.book.census().note(host, &list);
                self.book
                    .census()
                    .shared(host, mac, name)
                    .unwrap_or_default()
            }
            Err(e) => {
                tracing::debug!(host, domain = name, error = %e, "MAC census listing failed");
                false
            }
        }
    }

    /// Whether the guest applied its seed: the agent's host name against the seed's
    /// `local-hostname` (the Proxy's name); `None` when the agent does not answer.
    async fn seed_applied(&self, host: &str, name: &str, local_hostname: &str) -> Option<bool> {
        match self.ops.guest_hostname(host, name).await {
            Ok(Some(reported)) => {
                let applied = seed::hostname_applied(&reported, local_hostname);
                tracing::debug!(
                    host,
                    domain = name,
                    applied,
                    "guest host name checked against the seed"
                );
                Some(applied)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(host, domain = name, error = %e, "guest host name not read");
                None
            }
        }
    }

    /// Removes what a failed Create made; what remains (cleanup failed) is adopted or
    /// replaced by the next Create, or collected by GC.
    async fn cleanup(&self, host: &str, pool: &str, identity: &InstanceIdentity, made: &Made) {
        if made.domain
            && let Err(e) = self.remove_domain(host, &identity.domain_name).await
        {
            tracing::warn!(host, domain = %identity.domain_name, error = %e, "cleanup: could not remove the domain");
        }
        for (flag, name) in [
            (made.seed, &identity.seed_volume),
            (made.root, &identity.root_volume),
        ] {
            if flag && let Err(e) = self.ops.delete_volume(host, pool, name).await {
                tracing::warn!(host, volume = %name, error = %e, "cleanup: could not remove a volume");
            }
        }
    }

    /// Destroys (no graceful wait) and undefines a domain.
    async fn remove_domain(&self, host: &str, name: &str) -> Result<(), Kvm2Error> {
        self.ops
            .destroy(host, name)
            .await
            .map_err(step("domain destroy"))?;
        self.ops
            .undefine(host, name)
            .await
            .map_err(step("domain undefine"))?;
        self.index().undefined(host, name);
        Ok(())
    }

    async fn get_inner(&self, id: &InstanceId) -> Result<Instance, Kvm2Error> {
        self.host(&id.host)?;
        let rec = self
            .ops
            .domain(&id.host, &id.name)
            .await
            .map_err(step("domain lookup"))?
            .ok_or_else(|| Kvm2Error::NotFound(id.clone()))?;
        let named_uid = id.name.strip_prefix(crate::instance::NAME_PREFIX);
        let Some(mark) = rec
            .mark
            .clone()
            .filter(|m| self.is_ours(m) && Some(m.uid.as_str()) == named_uid)
        else {
            // A domain under that name whose mark is not ours for that UID is not our
            // instance: refused, so no caller takes it for its own (or replaces it).
            return Err(Kvm2Error::Foreign {
                host: id.host.clone(),
                domain: id.name.clone(),
                owner: owner_of_mark(rec.mark.as_ref()),
            });
        };
        let mut inst = self.instance(&id.host, &rec, &mark);
        // Only a running instance has addresses: a stopped domain's lease or ARP entry
        // can outlive it, and its static address answers nothing.
        if rec.state == InstanceState::Running {
            let host = self.host(&id.host)?;
            self.report(&host, &mark, &mut inst).await;
        }
        Ok(inst)
    }

    async fn delete_inner(&self, id: &InstanceId) -> Result<(), Kvm2Error> {
        let host = self.host(&id.host)?;
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let _name_lock = self.names.lock(&id.name).await;
        let rec = self
            .ops
            .domain(h, &id.name)
            .await
            .map_err(step("domain lookup"))?;
        // Volume names come from the instance name (egress-<uid>), never from a mark: a
        // domain whose mark names another Proxy must not lead us to that Proxy's volumes.
        let uid = id
            .name
            .strip_prefix(crate::instance::NAME_PREFIX)
            .unwrap_or_default()
            .to_string();
        if let Some(r) = &rec {
            let ours = r.mark.as_ref().filter(|m| self.is_ours(m));
            if ours.is_none_or(|m| m.uid != uid) {
                return Err(Kvm2Error::Foreign {
                    host: h.into(),
                    domain: id.name.clone(),
                    owner: owner_of_mark(r.mark.as_ref()),
                });
            }
        }
        let identity = InstanceIdentity::for_uid(&uid).map_err(Kvm2Error::InvalidRequest)?;
        if let Some(rec) = rec {
            if rec.state == InstanceState::Running {
                self.graceful_stop(h, &id.name).await?;
            }
            self.remove_domain(h, &id.name).await?;
        }
        for name in [&identity.seed_volume, &identity.root_volume] {
            self.ops
                .delete_volume(h, pool, name)
                .await
                .map_err(step("volume delete"))?;
        }
        Ok(())
    }

    /// Asks the guest to shut down and waits (bounded) for it; the caller destroys after.
    async fn graceful_stop(&self, host: &str, name: &str) -> Result<(), Kvm2Error> {
        self.ops
            .shutdown(host, name)
            .await
            .map_err(step("domain shutdown"))?;
        let started = Instant::now();
        while started.elapsed() < self.options.shutdown_timeout {
            match self
                .ops
                .domain(host, name)
                .await
                .map_err(step("domain state"))?
            {
                Some(r) if r.state == InstanceState::Running || r.state == InstanceState::Dying => {
                    tokio::time::sleep(self.options.poll_every).await;
                }
                _ => return Ok(()),
            }
        }
        tracing::info!(
            host,
            domain = name,
            "guest did not shut down in time; destroying"
        );
        Ok(())
    }

    async fn list_inner(&self) -> Vec<TargetListing> {
        let config = self.config();
        let futures = config.kvm2.hosts.iter().map(|host| async move {
            let result = self
                .index()
                .domains(self.ops.as_ref(), &host.name, Fresh::Full)
                .await
                .map_err(|e| {
                    ProviderError::new(Kvm2Error::Ops {
                        step: "domain list",
                        source: e,
                    })
                })
                .and_then(|list| {
                    self.book.census().note(&host.name, &list);
                    // The listing feeds the collector: a host a twin shares is refused.
                    self.refuse_twins(&host.name, &list)
                        .map_err(ProviderError::new)?;
                    Ok(list
                        .iter()
                        .filter_map(|rec| {
                            let mark = rec.mark.as_ref().filter(|m| self.is_ours(m))?;
                            Some(self.instance(&host.name, rec, mark))
                        })
                        .collect())
                });
            TargetListing {
                target: host.name.clone(),
                result,
            }
        });
        futures_util::future::join_all(futures).await
    }
}

impl Provider for Kvm2Provider {
    fn name(&self) -> &str {
        PROVIDER_NAME
    }

    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move { self.create_inner(req).await.map_err(ProviderError::new) })
    }

    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move { self.get_inner(id).await.map_err(ProviderError::new) })
    }

    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move { self.delete_inner(id).await.map_err(ProviderError::new) })
    }

    /// Without the extra read of the default: the name carries the owner's UID (volumes
    /// are found from it), and the kvm2 delete refuses a domain whose mark
    /// names another UID than its name, so checking the name is checking the mark.
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            let named = id
                .name
                .strip_prefix(crate::instance::NAME_PREFIX)
                .unwrap_or_default();
            crate::provider::NotOwned::check(id, owner, named)?;
            self.delete_inner(id).await.map_err(ProviderError::new)
        })
    }

    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(self.list_inner())
    }

    /// From the domain index, checked now on every host (one names-only listing each),
    /// never a full listing: the domain's name carries the owner's UID. The states are as
    /// the index last read them (a Delete needs only the IDs).
    fn instances_of<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<TargetListing>> {
        Box::pin(async move {
            let name = format!("{}{owner}", crate::instance::NAME_PREFIX);
            let config = self.config();
            let futures = config.kvm2.hosts.iter().map(|host| {
                let name = name.clone();
                async move {
                    let result = self
                        .index()
                        .domains(self.ops.as_ref(), &host.name, Fresh::Now)
                        .await
                        .map_err(|e| {
                            ProviderError::new(Kvm2Error::Ops {
                                step: "domain list",
                                source: e,
                            })
                        })
                        .map(|list| {
                            list.iter()
                                .filter(|rec| rec.name == name)
                                .filter_map(|rec| {
                                    let mark = rec
                                        .mark
                                        .as_ref()
                                        .filter(|m| self.is_ours(m) && m.uid == owner)?;
                                    Some(self.instance(&host.name, rec, mark))
                                })
                                .collect()
                        });
                    TargetListing {
                        target: host.name.clone(),
                        result,
                    }
                }
            });
            futures_util::future::join_all(futures).await
        })
    }

    fn health(&self) -> Option<&dyn HealthCheck> {
        Some(self)
    }

    fn sever(&self, bound: Duration) -> BoxFuture<'_, crate::provider::Severed> {
        self.ops.sever(bound)
    }

    fn revision(
        &self,
        spec: &crate::api::proxy::ProxySpec,
        host: Option<&str>,
        user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        // Until both plugins are loaded their digests are not known (a `path` plugin need
        // not pin one), and neither is the revision.
        let domain = self.live.templates().domain().ok()?;
        let vendor_data = self.live.templates().vendor_data().ok()?;
        let digests = crate::revision::PluginDigests {
            domain: domain.sha256(),
            vendor_data: vendor_data.sha256(),
        };
        Some(crate::revision::Revision::of(
            &self.config(),
            digests,
            spec,
            host,
            user_data,
        ))
    }

    fn reconnect(&self) {
        self.ops.reconnect();
    }
}

impl HealthCheck for Kvm2Provider {
    /// Every host at once, each on a dedicated connection bounded by `timeout` (see
    /// [`HostOps::health_probe`]), reporting the dial stage that failed.
    fn check(&self, timeout: Duration) -> BoxFuture<'_, Vec<TargetHealth>> {
        Box::pin(async move {
            let config = self.config();
            let futures = config.kvm2.hosts.iter().map(|host| async move {
                let started = Instant::now();
                let probe = self
                    .ops
                    .health_probe(&host.name, &host.storage_pool, timeout);
                // The probe bounds itself; this is the backstop for a double that does not.
                let (reachable, reason, stage, message) =
                    match tokio::time::timeout(timeout + HEALTH_GRACE, probe).await {
                        Ok(Ok(space)) => (
                            true,
                            None,
                            None,
                            format!(
                                "pool {} has {} bytes free",
                                host.storage_pool, space.available
                            ),
                        ),
                        Ok(Err(e)) => (false, Some(reason_code(&e)), stage(&e), e.to_string()),
                        Err(_) => (
                            false,
                            Some("timeout".to_string()),
                            None,
                            format!("no answer within {timeout:?}"),
                        ),
                    };
                TargetHealth {
                    target: host.name.clone(),
                    reachable,
                    reason,
                    stage,
                    message,
                    latency: started.elapsed(),
                }
            });
            futures_util::future::join_all(futures).await
        })
    }
}

/// Slack on top of a health probe's own bound before the check gives up on it.
const HEALTH_GRACE: Duration = Duration::from_secs(1);

/// The dial stage a health probe failed at, as a stable code.
fn stage(e: &OpsError) -> Option<String> {
    match e {
        OpsError::Host(h) => h.stage().map(str::to_string),
        _ => None,
    }
}

fn reason_code(e: &OpsError) -> String {
    match e {
        OpsError::Host(h) => match h.libvirt() {
            Some(l) if l.class() == ErrorClass::NotFound => "pool-missing".into(),
            _ => h.reason_code().into(),
        },
        OpsError::UploadAborted { .. } => "upload".into(),
        OpsError::Unsendable { .. } => "unsendable".into(),
        OpsError::Injected { .. } => "injected".into(),
    }
}

// ---- Leftover volumes: what the garbage collector may delete ------------------------

impl Kvm2Provider {
    /// Digests (as in volume names) of the images the config has: their volumes belong to
    /// the image cache's protocol and are never offered for collection.
    fn configured_digests(&self) -> BTreeSet<String> {
        self.config()
            .kvm2
            .images
            .iter()
            .map(|i| crate::instance::image_digest(&i.sha256))
            .collect()
    }

    /// One host's leftover candidates; an error when either listing fails (a partial
    /// picture would make used volumes look unused).
    async fn volume_candidates_on(
        &self,
        host: &HostConfig,
    ) -> Result<Vec<VolumeCandidate>, Kvm2Error> {
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let domains = self
            .index()
            .domains(self.ops.as_ref(), h, Fresh::Full)
            .await
            .map_err(step("domain list"))?;
        let volumes = self
            .ops
            .list_volumes(h, pool)
            .await
            .map_err(step("volume list"))?;
        self.refuse_twins(h, &domains)?;
        let mut candidates = leftover_volumes(&self.configured_digests(), &domains, &volumes);
        // A host shared with other clusters shares its images by content: another cluster
        // may have a retired image configured and be about to put an overlay on it,
        // which no listing here can show (an overlay already there keeps its base by
        // the backing-store check above). What another cluster announced it uses here,
        // while fresh, is not collected; an announcement abandoned for long is.
        let me = self.me()?;
        let others = self
            .uses
            .others(&me, self.ops.as_ref(), h, pool, &volumes)
            .await
            .map_err(step("image announcements read"))?;
        let image_prefix = format!("{}image-", crate::instance::NAME_PREFIX);
        let before = candidates.len();
        candidates.retain(|c| {
            let keep = c.kind == VolumeKind::UnusedImage
                && others
                    .held
                    .keeps(c.key.strip_prefix(&image_prefix).unwrap_or(&c.key));
            if keep {
                tracing::debug!(host = h, image = %c.key,
                    "another cluster announced it uses this image here; not collected");
            }
            !keep
        });
        self.options
            .sharing
            .observe_kept_shared(h, before - candidates.len());
        candidates.extend(others.abandoned.into_iter().map(|name| VolumeCandidate {
            key: name.clone(),
            kind: VolumeKind::Announcement,
            owner_uid: None,
            volumes: vec![name],
        }));
        // Start (or go on) watching the heartbeats of staging leftovers.
        for c in candidates.iter().filter(|c| c.kind == VolumeKind::Staging) {
            if let Some(beat) = heartbeat_of(c) {
                self.upload_alive(h, pool, beat).await?;
            }
        }
        Ok(candidates)
    }

    /// Whether the image upload whose heartbeat volume is `name` is alive: its record
    /// changed (or first seen) less than the image cache's stale window ago. An uploader
    /// beats every quarter of that window, whichever cluster or replica it is, so a live
    /// upload, however slow, is never collected.
    async fn upload_alive(&self, host: &str, pool: &str, name: &str) -> Result<bool, Kvm2Error> {
        let record = self
            .ops
            .read_volume(
                host,
                pool,
                name,
                crate::provider::kvm2::image::HEARTBEAT_LEN,
            )
            .await
            .map_err(step("heartbeat read"))?;
        let now = tokio::time::Instant::now();
        let mut beats = self.beats.lock().unwrap_or_else(|p| p.into_inner());
        let since = match beats.get_mut(&(host.to_string(), name.to_string())) {
            Some((seen, since)) if *seen == record => *since,
            Some(entry) => {
                *entry = (record, now);
                now
            }
            None => {
                beats.insert((host.to_string(), name.to_string()), (record, now));
                now
            }
        };
        Ok(now.duration_since(since) < self.options.images.stale_after)
    }

    async fn delete_leftover(
        &self,
        target: &str,
        candidate: &VolumeCandidate,
    ) -> Result<VolumeDeleteOutcome, Kvm2Error> {
        let host = self.host(target)?;
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let volumes: Vec<String> = match candidate.kind {
            VolumeKind::Instance => {
                let uid = candidate.owner_uid.as_deref().unwrap_or_default();
                let identity = InstanceIdentity::for_uid(uid).map_err(Kvm2Error::InvalidRequest)?;
                // Under the domain's name lock, so a Create of this instance in this
                // process is either done (its domain exists) or not started.
                let _name_lock = self.names.lock(&identity.domain_name).await;
                if self
                    .ops
                    .domain(h, &identity.domain_name)
                    .await
                    .map_err(step("domain lookup"))?
                    .is_some()
                {
                    return Ok(VolumeDeleteOutcome::Changed(format!(
                        "domain {} exists again",
                        identity.domain_name
                    )));
                }
                // Only this instance's own names, whatever the candidate listed.
                for name in [&identity.seed_volume, &identity.root_volume] {
                    self.ops
                        .delete_volume(h, pool, name)
                        .await
                        .map_err(step("volume delete"))?;
                }
                return Ok(VolumeDeleteOutcome::Deleted);
            }
            VolumeKind::Staging | VolumeKind::UnusedImage | VolumeKind::Announcement => {
                // Judge again on a fresh listing: an overlay made since over this base
                // (by a replica whose config still has the image) keeps it.
                let fresh = self.volume_candidates_on(&host).await?;
                match fresh
                    .into_iter()
                    .find(|c| c.key == candidate.key && c.kind == candidate.kind)
                {
                    Some(c) => {
                        if let Some(beat) = heartbeat_of(&c)
                            && self.upload_alive(h, pool, beat).await?
                        {
                            return Ok(VolumeDeleteOutcome::Changed(format!(
                                "the upload's heartbeat {beat} changed within the stale window: \
                                 an upload is alive"
                            )));
                        }
                        c.volumes
                    }
                    None => {
                        return Ok(VolumeDeleteOutcome::Changed(format!(
                            "{} is no longer an unused {} leftover",
                            candidate.key,
                            candidate.kind.as_str()
                        )));
                    }
                }
            }
        };
        for name in &volumes {
            self.ops
                .delete_volume(h, pool, name)
                .await
                .map_err(step("volume delete"))?;
        }
        Ok(VolumeDeleteOutcome::Deleted)
    }
}

/// The heartbeat volume among a candidate's volumes, if it has one.
fn heartbeat_of(c: &VolumeCandidate) -> Option<&str> {
    c.volumes
        .iter()
        .find(|v| {
            matches!(
                VolumeName::parse(v),
                Some(VolumeName::ImageHeartbeat { .. })
            )
        })
        .map(String::as_str)
}

/// The parts of one image's volumes found in a pool.
#[derive(Default)]
struct ImageParts<'a> {
    data: Option<&'a VolumeEntry>,
    marker: Option<&'a str>,
    claim: Option<&'a str>,
    heartbeat: Option<&'a str>,
}

/// Classifies a pool's volumes (names we make, read back by [`VolumeName::parse`]) into
/// leftover candidates, given the host's domains (any domain of an instance's name, ours
/// or not, keeps its volumes) and the images still configured (never candidates).
///
/// - Instance: root and/or seed of a UID with no domain of that name.
/// - Unused image: a verified (marker present) data volume of a retired image that no
///   volume uses as its backing store; deleted marker first, so it is never a verified
///   base without its data.
/// - Staging: any other volumes of a retired image (data without marker, a marker, claim
///   or heartbeat alone), unless something uses its data volume.
fn leftover_volumes(
    configured: &BTreeSet<String>,
    domains: &[DomainRecord],
    volumes: &[VolumeEntry],
) -> Vec<VolumeCandidate> {
    let mut instances: BTreeMap<String, (Option<&str>, Option<&str>)> = BTreeMap::new();
    let mut images: BTreeMap<String, ImageParts<'_>> = BTreeMap::new();
    for v in volumes {
        match VolumeName::parse(&v.name) {
            Some(VolumeName::Seed { uid }) => instances.entry(uid).or_default().0 = Some(&v.name),
            Some(VolumeName::Root { uid }) => instances.entry(uid).or_default().1 = Some(&v.name),
            Some(VolumeName::ImageData { digest }) => {
                images.entry(digest).or_default().data = Some(v)
            }
            Some(VolumeName::ImageMarker { digest }) => {
                images.entry(digest).or_default().marker = Some(&v.name);
            }
            Some(VolumeName::ImageClaim { digest }) => {
                images.entry(digest).or_default().claim = Some(&v.name);
            }
            Some(VolumeName::ImageHeartbeat { digest }) => {
                images.entry(digest).or_default().heartbeat = Some(&v.name);
            }
            // A cluster's image-use announcement: judged by its record (`uses`), not here.
            Some(VolumeName::ImageUse { .. }) | None => {}
        }
    }
    let mut out = Vec::new();
    for (uid, (seed, root)) in instances {
        let domain = format!("{}{uid}", crate::instance::NAME_PREFIX);
        if domains.iter().any(|d| d.name == domain) {
            continue;
        }
        out.push(VolumeCandidate {
            key: domain,
            kind: VolumeKind::Instance,
            owner_uid: Some(uid),
            volumes: [seed, root]
                .into_iter()
                .flatten()
                .map(str::to_string)
                .collect(),
        });
    }
    for (digest, parts) in images {
        if configured.contains(&digest) {
            continue;
        }
        if let Some(data) = parts.data
            && volumes
                .iter()
                .any(|v| v.backing.as_deref() == Some(data.path.as_str()))
        {
            continue;
        }
        let kind = if parts.data.is_some() && parts.marker.is_some() {
            VolumeKind::UnusedImage
        } else {
            VolumeKind::Staging
        };
        let volumes = [
            parts.marker,
            parts.data.map(|d| d.name.as_str()),
            parts.claim,
            parts.heartbeat,
        ]
        .into_iter()
        .flatten()
        .map(str::to_string)
        .collect();
        out.push(VolumeCandidate {
            key: format!("{}image-{digest}", crate::instance::NAME_PREFIX),
            kind,
            owner_uid: None,
            volumes,
        });
    }
    out
}

impl VolumeCollector for Kvm2Provider {
    fn name(&self) -> &str {
        PROVIDER_NAME
    }

    fn volume_candidates(&self) -> BoxFuture<'_, Vec<VolumeListing>> {
        Box::pin(async move {
            let config = self.config();
            let futures = config.kvm2.hosts.iter().map(|host| async move {
                VolumeListing {
                    target: host.name.clone(),
                    result: self
                        .volume_candidates_on(host)
                        .await
                        .map_err(ProviderError::new),
                }
            });
            futures_util::future::join_all(futures).await
        })
    }

    fn delete_volumes<'a>(
        &'a self,
        target: &'a str,
        candidate: &'a VolumeCandidate,
    ) -> BoxFuture<'a, Result<VolumeDeleteOutcome, ProviderError>> {
        Box::pin(async move {
            self.delete_leftover(target, candidate)
                .await
                .map_err(ProviderError::new)
        })
    }
}
