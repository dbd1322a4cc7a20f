//! The provider's per-host index of the domains with our name prefix, so a Create or a
//! Delete does not read every domain of a host (issue 32).
//!
//! A full listing reads each domain's state and XML: two round trips per domain, so its
//! cost grows with the host. The index keeps what it read, by name, with each domain's
//! UUID, and brings itself up to date with a names-only listing (one round trip: libvirt
//! returns name and UUID with each handle), reading only the domains that are new, or
//! whose UUID changed (undefined and defined again), and dropping those that went.
//!
//! What keeps it correct when the host changes behind the operator's back:
//! - **Another cluster, or `virsh define`/`undefine`.** A new or removed name, or a new
//!   UUID under an old name, is seen by the next names-only check. Address allocation
//!   checks at every Create (after taking its claims, as a full listing did before), so a
//!   domain another cluster defined before that check is never given the same MAC or
//!   address; placement and the `maxDomains` room check accept an index checked within
//!   [`RECENT`].
//! - **An edit in place (`virsh edit`, same UUID).** Not visible to a names-only check.
//!   Every full listing (each GC sweep, on every host) replaces the host's entries, so such
//!   an edit is seen within a GC period. Our own marks are only written at define.
//! - **Our own define and undefine** update the index at once ([`DomainIndex::defined`],
//!   [`DomainIndex::undefined`]). A check that was in flight meanwhile does not undo them:
//!   each local change is stamped, and a check that began before it leaves that name as
//!   the change left it.
//! - **A new leader** starts with an empty index; its first look at a host is a full
//!   listing.
//!
//! The states kept are as last read: callers that need a domain's state now ask libvirt
//! ([`HostOps::domain`]). Checks of one host run one at a time, and a caller that asked
//! while a check was under way waits for it and uses the next one that began after it
//! asked (never an older one).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use super::ops::{DomainName, DomainRecord, HostOps, OpsError};

/// How old an index may be for placement and the room check: a heuristic and a count of
/// our own domains, which the index tracks exactly as this process defines and undefines
/// them.
pub const RECENT: Duration = Duration::from_secs(5);

/// When more domains than this are new to the index at a check, one full listing reads
/// them all instead of one lookup each (the same round trips, one blocking call).
const READ_ONE_BY_ONE: usize = 8;

/// How fresh a caller needs the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fresh {
    /// Checked by a names-only listing that began after this call.
    Now,
    /// Checked within this long; otherwise as [`Fresh::Now`].
    Within(Duration),
    /// A full listing that began after this call (states and marks read again): the GC,
    /// and anything that reports states.
    Full,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ViaLabels {
    host: String,
    via: String,
}

/// Counters of the index's work per host.
#[derive(Debug, Clone, Default)]
pub struct IndexMetrics {
    checks: Family<ViaLabels, Counter>,
    read: Family<ViaLabels, Counter>,
}

impl IndexMetrics {
    /// Registered as `egress_kvm2_domain_index_checks` and `egress_kvm2_domains_read`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_kvm2_domain_index_checks",
            "domain index checks of a host, by kind (names: one round trip; full: two per domain; cached: none)",
            m.checks.clone(),
        );
        registry.register(
            "egress_kvm2_domains_read",
            "domains whose state and XML the provider read (two round trips each), by way: full (a full listing), bulk (a names check that found many new domains lists in full), lookup (one domain new to the index)",
            m.read.clone(),
        );
        m
    }

    fn count(&self, family: &Family<ViaLabels, Counter>, host: &str, via: &str, n: usize) {
        family
            .get_or_create(&ViaLabels {
                host: host.into(),
                via: via.into(),
            })
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }

    /// Checks of `host` of kind `via` (`names`, `full`, `cached`), for tests.
    pub fn checks(&self, host: &str, via: &str) -> u64 {
        self.checks
            .get(&ViaLabels {
                host: host.into(),
                via: via.into(),
            })
            .map_or(0, |c| c.get())
    }

    /// Domains of `host` read by way `via` (`full`, `bulk`, `lookup`), for tests.
    pub fn read(&self, host: &str, via: &str) -> u64 {
        self.read
            .get(&ViaLabels {
                host: host.into(),
                via: via.into(),
            })
            .map_or(0, |c| c.get())
    }
}

#[derive(Debug, Default)]
struct HostState {
    domains: BTreeMap<String, DomainRecord>,
    /// Bumped by every local change.
    epoch: u64,
    /// The epoch of each name's last local change since the last check.
    touched: HashMap<String, u64>,
    /// When the last check began (its listing shows the host as of then or later).
    checked_at: Option<Instant>,
    /// Checks begun so far, and the number of the last one that completed: a caller may
    /// use a check only if it began after the call (a number above what had begun then).
    begun: u64,
    completed: u64,
    /// Names this process is defining now ([`DomainIndex::defining`]): a check does not
    /// read them, as [`DomainIndex::defined`] records them in a moment. Their MACs and
    /// addresses are held by the allocation's claims meanwhile, their slots by the room
    /// check's reservations.
    pending: HashMap<String, usize>,
}

#[derive(Debug, Default)]
struct HostIndex {
    state: Mutex<HostState>,
    /// One check of the host at a time.
    check: tokio::sync::Mutex<()>,
}

/// The index of every host (see the module documentation).
#[derive(Debug, Default)]
pub struct DomainIndex {
    hosts: Mutex<HashMap<String, Arc<HostIndex>>>,
    metrics: IndexMetrics,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl DomainIndex {
    /// An empty index counting into `metrics`.
    pub fn new(metrics: IndexMetrics) -> Self {
        Self {
            hosts: Mutex::default(),
            metrics,
        }
    }

    fn host(&self, host: &str) -> Arc<HostIndex> {
        lock(&self.hosts)
            .entry(host.to_string())
            .or_default()
            .clone()
    }

    /// The domains of `host` with our prefix, as fresh as `fresh` asks.
    pub async fn domains(
        &self,
        ops: &dyn HostOps,
        host: &str,
        fresh: Fresh,
    ) -> Result<Vec<DomainRecord>, OpsError> {
        let index = self.host(host);
        let begun_before = {
            let st = lock(&index.state);
            if let Fresh::Within(age) = fresh
                && st.checked_at.is_some_and(|t| t.elapsed() <= age)
            {
                self.metrics.count(&self.metrics.checks, host, "cached", 1);
                return Ok(snapshot(&st));
            }
            st.begun
        };
        let _one = index.check.lock().await;
        let (began, epoch, empty, number) = {
            let mut st = lock(&index.state);
            // A check that began after this call while it waited answers it as well,
            // unless a full one is asked for.
            if fresh != Fresh::Full && st.completed > begun_before {
                self.metrics.count(&self.metrics.checks, host, "cached", 1);
                return Ok(snapshot(&st));
            }
            st.begun += 1;
            (Instant::now(), st.epoch, st.checked_at.is_none(), st.begun)
        };
        if fresh == Fresh::Full || empty {
            let list = ops.list_domains(host).await?;
            self.metrics.count(&self.metrics.checks, host, "full", 1);
            self.metrics
                .count(&self.metrics.read, host, "full", list.len());
            let mut st = lock(&index.state);
            install_full(&mut st, list, epoch);
            st.checked_at = Some(began);
            st.completed = number;
            st.touched.clear();
            return Ok(snapshot(&st));
        }
        let names = ops.list_domain_names(host).await?;
        self.metrics.count(&self.metrics.checks, host, "names", 1);
        let unknown: Vec<&str> = {
            let st = lock(&index.state);
            names
                .iter()
                .filter(|n| !st.pending.contains_key(&n.name))
                .filter(|n| st.domains.get(&n.name).is_none_or(|e| e.uuid != n.uuid))
                .map(|n| n.name.as_str())
                .collect()
        };
        let mut read: BTreeMap<String, Option<DomainRecord>> = BTreeMap::new();
        if unknown.len() > READ_ONE_BY_ONE {
            let list = ops.list_domains(host).await?;
            self.metrics
                .count(&self.metrics.read, host, "bulk", list.len());
            let mut by_name: BTreeMap<String, DomainRecord> =
                list.into_iter().map(|r| (r.name.clone(), r)).collect();
            for name in &unknown {
                read.insert((*name).to_string(), by_name.remove(*name));
            }
        } else {
            for name in &unknown {
                let found = ops.domain(host, name).await?;
                self.metrics.count(&self.metrics.read, host, "lookup", 1);
                read.insert((*name).to_string(), found);
            }
        }
        let mut st = lock(&index.state);
        apply_check(&mut st, &names, read, epoch);
        st.checked_at = Some(began);
        st.completed = number;
        st.touched.clear();
        Ok(snapshot(&st))
    }

    /// Records a domain this process has just defined (and read back).
    pub fn defined(&self, host: &str, record: DomainRecord) {
        let index = self.host(host);
        let mut st = lock(&index.state);
        st.epoch += 1;
        let epoch = st.epoch;
        st.touched.insert(record.name.clone(), epoch);
        st.domains.insert(record.name.clone(), record);
    }

    /// Marks `name` as being defined on `host` by this process until the guard drops (after
    /// [`DomainIndex::defined`], or on a failure): checks meanwhile do not read it.
    pub fn defining(&self, host: &str, name: &str) -> Defining {
        let index = self.host(host);
        *lock(&index.state)
            .pending
            .entry(name.to_string())
            .or_default() += 1;
        Defining {
            index,
            name: name.to_string(),
        }
    }

    /// Records a domain this process has just undefined.
    pub fn undefined(&self, host: &str, name: &str) {
        let index = self.host(host);
        let mut st = lock(&index.state);
        st.epoch += 1;
        let epoch = st.epoch;
        st.touched.insert(name.to_string(), epoch);
        st.domains.remove(name);
    }

    /// Forgets what the index knows of `host`: its next look is a full listing (after a
    /// failure that leaves its picture in doubt).
    pub fn forget(&self, host: &str) {
        let index = self.host(host);
        let mut st = lock(&index.state);
        st.domains.clear();
        st.checked_at = None;
        st.completed = 0;
        st.epoch += 1;
        st.touched.clear();
    }

    /// The metrics it counts into.
    pub fn metrics(&self) -> &IndexMetrics {
        &self.metrics
    }
}

/// Applies a names-only check begun at `epoch`: names no longer listed go, the domains
/// read (new names and new UUIDs) come in, and a name changed locally since is left as
/// that change left it.
fn apply_check(
    st: &mut HostState,
    names: &[DomainName],
    read: BTreeMap<String, Option<DomainRecord>>,
    epoch: u64,
) {
    let newer = |st: &HostState, name: &str| st.touched.get(name).is_some_and(|e| *e > epoch);
    let listed: HashSet<&str> = names.iter().map(|n| n.name.as_str()).collect();
    let gone: Vec<String> = st
        .domains
        .keys()
        .filter(|k| !listed.contains(k.as_str()))
        .cloned()
        .collect();
    for name in gone {
        if !newer(st, &name) {
            st.domains.remove(&name);
        }
    }
    for (name, found) in read {
        if newer(st, &name) {
            continue;
        }
        match found {
            Some(record) => {
                st.domains.insert(name, record);
            }
            // Undefined between the listing and the read.
            None => {
                st.domains.remove(&name);
            }
        }
    }
}

/// A name being defined ([`DomainIndex::defining`]).
#[derive(Debug)]
pub struct Defining {
    index: Arc<HostIndex>,
    name: String,
}

impl Drop for Defining {
    fn drop(&mut self) {
        let mut st = lock(&self.index.state);
        if let Some(n) = st.pending.get_mut(&self.name) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.pending.remove(&self.name);
            }
        }
    }
}

/// Replaces the entries with a full listing begun at `epoch`, keeping every name changed
/// locally since as the change left it.
fn install_full(st: &mut HostState, list: Vec<DomainRecord>, epoch: u64) {
    let mut next: BTreeMap<String, DomainRecord> = BTreeMap::new();
    for record in list {
        if st.touched.get(&record.name).is_some_and(|e| *e > epoch) {
            continue;
        }
        next.insert(record.name.clone(), record);
    }
    for (name, e) in &st.touched {
        if *e > epoch {
            if let Some(kept) = st.domains.get(name) {
                next.insert(name.clone(), kept.clone());
            } else {
                next.remove(name);
            }
        }
    }
    st.domains = next;
}

fn snapshot(st: &HostState) -> Vec<DomainRecord> {
    st.domains.values().cloned().collect()
}

#[cfg(test)]
mod tests;
