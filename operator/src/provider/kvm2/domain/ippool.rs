//! The network identity of a new instance: its MAC and, when its host has an address
//! pool, its static address, both conflict-free on the host.
//!
//! Where the truth lives: in the marks of the host's domains. Every domain a Create
//! defines records its MAC and static address in its mark
//! ([`crate::instance::MetadataMark`]), so the used
//! addresses and MACs of a host are read from a listing of its domains, and an operator
//! that restarts (or a replica that takes over) recovers every allocation from the host
//! itself. What a listing cannot show yet, the allocations of Creates in flight in this
//! process that have not defined their domain, is held in memory ([`Allocation`]) until
//! the Create ends. Allocation on a host is serialised (a per-host lock around listing,
//! choosing and claiming), so two Creates racing in one process never choose the same
//! address; two replicas never create at once (leader fencing).
//!
//! Choice rules:
//! - **Address**: the range's `(sha256(uid) mod size)`-th address is preferred, then the
//!   next ones upward, wrapping at the end of the range; the first one no mark and no
//!   claim uses is taken. A replacement of a Proxy's VM (the old domain is gone by then)
//!   therefore gets the same address again unless another Proxy took it meanwhile: the
//!   address a consumer allow-listed stays valid. A full range is a quota error naming the
//!   host and the range.
//! - **MAC**: [`derive_mac`] of the UID and a fresh incarnation; should another domain of
//!   the host (or a claim) carry it already, the next attempt number is derived, up to
//!   [`MAC_ATTEMPTS`]. With 46 random bits a single retry is already astronomically rare.
//!
//! The [`MacCensus`] is the read side: which MACs the host's domains carry, refreshed from
//! every listing the provider makes, so a Get can refuse to publish an address found by a
//! MAC that two domains share without listing the host on every Get.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::index::{DomainIndex, Fresh};
use super::ops::{DomainRecord, HostOps, OpsError};
use crate::config::AddressPool;
use crate::error::{Classified, ErrorClass};
use crate::instance::{InstanceNet, derive_mac};
use crate::provider::kvm2::locks::KeyedLocks;

/// Derivations tried for a MAC before giving up: each one collides with probability
/// about `domains / 2^46`, so the limit is never reached on a real host; it only bounds
/// the loop.
pub const MAC_ATTEMPTS: u32 = 8;

/// How old a census may be before a Get lists the host again to check a MAC. A collision
/// can only appear through a new domain, which the Create-time check already screens, so
/// a minute of staleness costs little, and at most one listing per host per minute is
/// cheap even with thousands of domains.
pub const CENSUS_MAX_AGE: Duration = Duration::from_secs(60);

/// Why no network identity could be allocated.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// Listing the host's domains (to see what is used) failed.
    #[error("listing the domains of host {host:?} to allocate an address: {source}")]
    List {
        /// Host.
        host: String,
        /// What failed.
        #[source]
        source: OpsError,
    },
    /// Every address of the pool's range is used.
    #[error(
        "the address pool of host {host:?} ({range} in {net}) is exhausted: all {size} \
         addresses are used by domains or Creates in flight"
    )]
    Exhausted {
        /// Host.
        host: String,
        /// The range, `first-last`.
        range: String,
        /// The bridge network.
        net: String,
        /// Addresses in the range.
        size: u32,
    },
    /// A domain of the host carries a damaged mark, so the address it uses is unknown:
    /// none is handed out until it is repaired or removed, rather than one it may use.
    #[error(
        "domain {domain:?} on host {host:?} carries a damaged ownership mark, so the static \
         address it may use is unknown; no address is handed out on this host until its mark \
         is repaired or the domain is removed"
    )]
    DamagedMark {
        /// Host.
        host: String,
        /// The domain with the damaged mark.
        domain: String,
    },
    /// Every derivation of a MAC was already on the host.
    #[error(
        "no free MAC for UID {uid} on host {host:?} after {attempts} derivations; \
         retrying with a new incarnation"
    )]
    NoFreeMac {
        /// Host.
        host: String,
        /// The Proxy UID.
        uid: String,
        /// Derivations tried.
        attempts: u32,
    },
}

impl Classified for AllocError {
    fn class(&self) -> ErrorClass {
        match self {
            AllocError::List { source, .. } => source.class(),
            // Frees up when a Proxy goes, like a host at maxDomains.
            AllocError::Exhausted { .. } => ErrorClass::Quota,
            // Clears when someone repairs or removes the domain; retried meanwhile.
            AllocError::DamagedMark { .. } => ErrorClass::Transient,
            // A new incarnation derives other MACs.
            AllocError::NoFreeMac { .. } => ErrorClass::Transient,
        }
    }
}

/// What one in-flight Create holds on a host.
#[derive(Debug, Clone)]
struct Claim {
    mac: String,
    address: Option<Ipv4Addr>,
}

type Claims = Arc<Mutex<BTreeMap<String, BTreeMap<String, Claim>>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Allocations of one provider: per-host locks, the claims of Creates in flight, the MAC
/// census, and the index of the hosts' domains that allocation reads.
#[derive(Debug, Default)]
pub struct AddressBook {
    locks: KeyedLocks,
    claims: Claims,
    census: MacCensus,
    index: DomainIndex,
}

/// A network identity claimed for one Create; the claim ends when this drops (by then the
/// domain is defined and its mark lists the identity, or the Create failed).
#[derive(Debug)]
pub struct Allocation {
    /// The MAC and static address to use.
    pub net: InstanceNet,
    host: String,
    uid: String,
    claims: Claims,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let mut claims = lock(&self.claims);
        if let Some(host) = claims.get_mut(&self.host) {
            host.remove(&self.uid);
            if host.is_empty() {
                claims.remove(&self.host);
            }
        }
    }
}

impl AddressBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// A book that reads the hosts' domains through `index`.
    pub fn with_index(index: DomainIndex) -> Self {
        Self {
            index,
            ..Self::default()
        }
    }

    /// The index of the hosts' domains that allocation reads.
    pub fn index(&self) -> &DomainIndex {
        &self.index
    }

    /// The census the book keeps up to date.
    pub fn census(&self) -> &MacCensus {
        &self.census
    }

    /// Allocates the network identity of a new domain of the Proxy `uid` on `host`: a MAC
    /// (incarnation `incarnation`) and, with `pool`, an address. Lists the host's domains
    /// under the host's allocation lock and claims the result until the returned guard
    /// drops.
    pub async fn allocate(
        &self,
        ops: &dyn HostOps,
        host: &str,
        uid: &str,
        pool: Option<&AddressPool>,
        incarnation: u64,
    ) -> Result<Allocation, AllocError> {
        let _host_lock = self.locks.lock(host).await;
        // The claims as they were before the listing: a Create in flight defines its
        // domain and only then drops its claim, so its identity is in this snapshot or
        // in the listing that follows. Read only after the listing, a claim dropped in
        // between (defined after the listing began) would be in neither.
        let claimed_before: Vec<Claim> = lock(&self.claims)
            .get(host)
            .into_iter()
            .flatten()
            .filter(|(other, _)| other.as_str() != uid)
            .map(|(_, c)| c.clone())
            .collect();
        // Checked now (a names-only listing begun after the claims were read): a domain
        // another cluster defined before this point is seen, whatever the index held.
        let domains = self
            .index
            .domains(ops, host, Fresh::Now)
            .await
            .map_err(|source| AllocError::List {
                host: host.into(),
                source,
            })?;
        self.census.note(host, &domains);
        let mut used_macs: BTreeSet<String> = BTreeSet::new();
        let mut used_addresses: BTreeSet<Ipv4Addr> = BTreeSet::new();
        for mark in domains.iter().filter_map(|d| d.mark.as_ref()) {
            used_macs.insert(mark.mac_or_legacy());
            used_addresses.extend(mark.address);
        }
        for claim in &claimed_before {
            used_macs.insert(claim.mac.clone());
            used_addresses.extend(claim.address);
        }
        let mut claims = lock(&self.claims);
        for (other, claim) in claims.get(host).into_iter().flatten() {
            if other != uid {
                used_macs.insert(claim.mac.clone());
                used_addresses.extend(claim.address);
            }
        }
        let mac = pick_mac(uid, incarnation, &used_macs).ok_or_else(|| AllocError::NoFreeMac {
            host: host.into(),
            uid: uid.into(),
            attempts: MAC_ATTEMPTS,
        })?;
        if pool.is_some()
            && let Some(d) = domains.iter().find(|d| d.damaged_mark)
        {
            return Err(AllocError::DamagedMark {
                host: host.into(),
                domain: d.name.clone(),
            });
        }
        let address = match pool {
            None => None,
            Some(pool) => Some(pick_address(pool, uid, &used_addresses).ok_or_else(|| {
                AllocError::Exhausted {
                    host: host.into(),
                    range: format!("{}-{}", pool.first, pool.last),
                    net: pool.net.to_string(),
                    size: pool.size(),
                }
            })?),
        };
        claims.entry(host.to_string()).or_default().insert(
            uid.to_string(),
            Claim {
                mac: mac.clone(),
                address,
            },
        );
        Ok(Allocation {
            net: InstanceNet { mac, address },
            host: host.into(),
            uid: uid.into(),
            claims: self.claims.clone(),
        })
    }

    /// Claims held now on `host` (for tests and metrics).
    pub fn claims_on(&self, host: &str) -> usize {
        lock(&self.claims).get(host).map_or(0, BTreeMap::len)
    }
}

/// The offset into a range of `size` addresses where the search for `uid` starts.
pub fn preferred_offset(uid: &str, size: u32) -> u32 {
    let d = Sha256::new()
        .chain_update(b"egress-operator/address/1\0")
        .chain_update(uid.as_bytes())
        .finalize();
    u32::from_be_bytes([d[0], d[1], d[2], d[3]]) % size.max(1)
}

/// The address for `uid`: the preferred one ([`preferred_offset`]) or the next free one
/// upward, wrapping; `None` when the whole range is used.
pub fn pick_address(pool: &AddressPool, uid: &str, used: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
    let size = pool.size();
    let start = preferred_offset(uid, size);
    let first = u32::from(pool.first);
    (0..size)
        .map(|i| Ipv4Addr::from(first + (start + i) % size))
        .find(|a| !used.contains(a) && Some(*a) != pool.gateway)
}

/// The first MAC derivation for `uid` and `incarnation` that is not in `taken`.
pub fn pick_mac(uid: &str, incarnation: u64, taken: &BTreeSet<String>) -> Option<String> {
    (0..MAC_ATTEMPTS)
        .map(|attempt| derive_mac(uid, incarnation, attempt))
        .find(|mac| !taken.contains(mac))
}

/// Which MACs the domains of each host carry, from the last listing of the host.
#[derive(Debug, Default)]
pub struct MacCensus {
    hosts: Mutex<BTreeMap<String, HostCensus>>,
}

#[derive(Debug)]
struct HostCensus {
    taken: Instant,
    /// MAC to the domains that carry it.
    macs: BTreeMap<String, BTreeSet<String>>,
}

impl MacCensus {
    /// Records a fresh listing of `host` (every domain with our name prefix).
    pub fn note(&self, host: &str, domains: &[DomainRecord]) {
        let mut macs: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for d in domains {
            if let Some(mark) = &d.mark {
                macs.entry(mark.mac_or_legacy())
                    .or_default()
                    .insert(d.name.clone());
            }
        }
        lock(&self.hosts).insert(
            host.to_string(),
            HostCensus {
                taken: Instant::now(),
                macs,
            },
        );
    }

    /// Whether a domain other than `domain` carries `mac` on `host`, by a census younger
    /// than [`CENSUS_MAX_AGE`]; `None` when there is none that fresh.
    pub fn shared(&self, host: &str, mac: &str, domain: &str) -> Option<bool> {
        let hosts = lock(&self.hosts);
        let census = hosts
            .get(host)
            .filter(|c| c.taken.elapsed() < CENSUS_MAX_AGE)?;
        Some(
            census
                .macs
                .get(mac)
                .is_some_and(|names| names.iter().any(|n| n != domain)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AddressPoolConfig;
    use crate::instance::MetadataMark;
    use crate::provider::InstanceState;
    use crate::provider::kvm2::fake::FakeOps;

    fn pool(start: &str, end: &str) -> AddressPool {
        AddressPoolConfig {
            cidr: "10.203.0.0/24".into(),
            gateway: Some("10.203.0.1".into()),
            dns: vec![],
            range_start: start.into(),
            range_end: end.into(),
        }
        .parse()
        .unwrap()
    }

    fn uid(n: u16) -> String {
        format!("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a69{n:04x}")
    }

    fn mark_xml(uid: &str, mac: Option<&str>, address: Option<&str>) -> String {
        let m = MetadataMark {
            cluster_id: "test".into(),
            cluster_uid: None,
            namespace: "default".into(),
            name: "p".into(),
            uid: uid.into(),
            created_at: "2026-01-01T00:00:00Z".into(),
            mac: mac.map(str::to_string),
            address: address.map(|a| a.parse().unwrap()),
        };
        format!(
            "<domain><name>egress-{uid}</name><metadata>{}</metadata></domain>",
            m.to_xml()
        )
    }

    #[test]
    fn address_preference_probes_upward_and_wraps() {
        let p = pool("10.203.0.10", "10.203.0.19");
        let u = uid(1);
        let start = preferred_offset(&u, 10);
        let want = |off: u32| Ipv4Addr::from(u32::from(p.first) + off % 10);
        assert_eq!(pick_address(&p, &u, &BTreeSet::new()), Some(want(start)));
        let used: BTreeSet<_> = [want(start), want(start + 1)].into();
        assert_eq!(pick_address(&p, &u, &used), Some(want(start + 2)));
        let all: BTreeSet<_> = (0..10).map(want).collect();
        assert_eq!(pick_address(&p, &u, &all), None);
        let one = pool("10.203.0.10", "10.203.0.10");
        assert_eq!(
            pick_address(&one, &u, &BTreeSet::new()),
            Some("10.203.0.10".parse().unwrap())
        );
    }

    #[test]
    fn mac_choice_skips_taken_derivations() {
        let u = uid(1);
        let first = derive_mac(&u, 7, 0);
        assert_eq!(pick_mac(&u, 7, &BTreeSet::new()), Some(first.clone()));
        let taken: BTreeSet<_> = [first].into();
        assert_eq!(pick_mac(&u, 7, &taken), Some(derive_mac(&u, 7, 1)));
        let all: BTreeSet<_> = (0..MAC_ATTEMPTS).map(|a| derive_mac(&u, 7, a)).collect();
        assert_eq!(pick_mac(&u, 7, &all), None);
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// Used addresses and MACs come from the marks on the host (what a restarted
    /// operator sees) and from claims of Creates in flight; a claim ends with its guard.
    #[test]
    fn allocation_reads_marks_and_claims() {
        rt().block_on(async {
            let fake = FakeOps::new(&["h1"], 1 << 30);
            let p = pool("10.203.0.10", "10.203.0.12");
            let book = AddressBook::new();
            // A domain left by an earlier process holds one address and a MAC.
            let old = uid(9);
            fake.put_domain(
                "h1",
                &format!("egress-{old}"),
                &mark_xml(&old, Some("02:00:00:00:00:09"), Some("10.203.0.11")),
                InstanceState::Running,
            );
            let a = book
                .allocate(&fake, "h1", &uid(1), Some(&p), 1)
                .await
                .unwrap();
            let b = book
                .allocate(&fake, "h1", &uid(2), Some(&p), 1)
                .await
                .unwrap();
            let mut got: BTreeSet<Ipv4Addr> = BTreeSet::new();
            got.extend(a.net.address);
            got.extend(b.net.address);
            got.insert("10.203.0.11".parse().unwrap());
            assert_eq!(got.len(), 3, "{a:?} {b:?}");
            assert_ne!(a.net.mac, b.net.mac);
            assert_eq!(book.claims_on("h1"), 2);
            // Full: quota, naming host and range.
            let err = book
                .allocate(&fake, "h1", &uid(3), Some(&p), 1)
                .await
                .unwrap_err();
            assert_eq!(err.class(), ErrorClass::Quota);
            let msg = err.to_string();
            assert!(
                msg.contains("\"h1\"") && msg.contains("10.203.0.10-10.203.0.12"),
                "{msg}"
            );
            // A claim dropped frees its address.
            let freed = a.net.address;
            drop(a);
            assert_eq!(book.claims_on("h1"), 1);
            let c = book
                .allocate(&fake, "h1", &uid(3), Some(&p), 1)
                .await
                .unwrap();
            assert_eq!(c.net.address, freed);
            // Without a pool: a MAC and no address.
            let d = book.allocate(&fake, "h1", &uid(4), None, 1).await.unwrap();
            assert_eq!(d.net.address, None);
        });
    }

    /// A MAC already on the host (in a mark) is not handed out again: the next
    /// derivation is.
    #[test]
    fn allocation_skips_a_mac_on_the_host() {
        rt().block_on(async {
            let fake = FakeOps::new(&["h1"], 1 << 30);
            let u = uid(1);
            let taken = derive_mac(&u, 5, 0);
            let other = uid(2);
            fake.put_domain(
                "h1",
                &format!("egress-{other}"),
                &mark_xml(&other, Some(&taken), None),
                InstanceState::Running,
            );
            let book = AddressBook::new();
            let a = book.allocate(&fake, "h1", &u, None, 5).await.unwrap();
            assert_eq!(a.net.mac, derive_mac(&u, 5, 1));
        });
    }

    /// Issue 19, finding 8: a domain whose mark is damaged may use any address of the
    /// pool; none is handed out (its own preferred one least of all) until it is fixed.
    #[test]
    fn a_damaged_mark_stops_address_allocation_on_its_host() {
        rt().block_on(async {
            let fake = FakeOps::new(&["h1"], 1 << 30);
            let p = pool("10.203.0.10", "10.203.0.19");
            let u = uid(1);
            let preferred = pick_address(&p, &u, &BTreeSet::new()).unwrap();
            let other = uid(2);
            let damaged = mark_xml(&other, None, Some(&preferred.to_string()))
                .replace("2026-01-01T00:00:00Z", "yesterday");
            let name = format!("egress-{other}");
            fake.put_domain("h1", &name, &damaged, InstanceState::Running);
            let book = AddressBook::new();
            let err = book
                .allocate(&fake, "h1", &u, Some(&p), 1)
                .await
                .unwrap_err();
            assert!(
                matches!(err, AllocError::DamagedMark { ref domain, .. } if *domain == name),
                "{err}"
            );
            assert_eq!(err.class(), ErrorClass::Transient);
            assert_eq!(book.claims_on("h1"), 0);
            // Without a pool there is no address to hand out twice.
            assert!(book.allocate(&fake, "h1", &u, None, 1).await.is_ok());
        });
    }

    #[test]
    fn census_sees_shared_macs_and_ages() {
        rt().block_on(async {
            let census = MacCensus::default();
            assert_eq!(census.shared("h1", "02:00:00:00:00:01", "egress-a"), None);
            let rec = |name: &str, u: &str, mac: &str| DomainRecord {
                uuid: format!("uuid-{name}"),
                name: name.into(),
                state: InstanceState::Running,
                mark: crate::provider::kvm2::metadata::mark_from_domain_xml(&mark_xml(
                    u,
                    Some(mac),
                    None,
                ))
                .unwrap(),
                damaged_mark: false,
            };
            census.note(
                "h1",
                &[
                    rec("egress-a", &uid(1), "02:00:00:00:00:01"),
                    rec("egress-b", &uid(2), "02:00:00:00:00:01"),
                    rec("egress-c", &uid(3), "02:00:00:00:00:03"),
                ],
            );
            assert_eq!(
                census.shared("h1", "02:00:00:00:00:01", "egress-a"),
                Some(true)
            );
            assert_eq!(
                census.shared("h1", "02:00:00:00:00:03", "egress-c"),
                Some(false)
            );
            tokio::time::advance(CENSUS_MAX_AGE).await;
            assert_eq!(census.shared("h1", "02:00:00:00:00:01", "egress-a"), None);
        });
    }
}
