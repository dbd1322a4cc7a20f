//! Test doubles for [`HostOps`]: an in-memory host ([`FakeOps`]) for unit tests of the
//! provider's own logic, and one forwarding wrapper ([`Hooked`]) that runs test hooks
//! around any `HostOps`, the real one included: the fault injector ([`FaultyOps`]) is one
//! such hook, so integration tests can fail a chosen step on real libvirt.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::addresses::{AddressSource, NicAddrs};
use super::metadata;
use super::ops::{
    Created, DefinedDomain, DomainName, DomainRecord, HostOps, OpsError, PoolSpace, UploadChunks,
    VolumeEntry, VolumeInfo, backing_path,
};
use crate::error::ErrorClass;
use crate::provider::{BoxFuture, InstanceState};
use crate::render::Facts;

#[derive(Debug, Clone)]
struct FakeVolume {
    capacity: u64,
    data: Vec<u8>,
    /// The backing store path its XML named (an overlay's base).
    backing: Option<String>,
}

#[derive(Debug, Clone)]
struct FakeDomain {
    xml: String,
    /// As libvirt's: kept when the domain is defined again, new when it is made anew.
    uuid: String,
    state: InstanceState,
    /// What each address source reports (nothing unless a test says).
    nics: BTreeMap<AddressSource, Vec<NicAddrs>>,
    /// The host name the guest agent answers; `None`: no agent.
    agent_hostname: Option<String>,
}

impl FakeDomain {
    fn new(xml: String, state: InstanceState) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            xml,
            uuid: format!("00000000-0000-4000-8000-{n:012x}"),
            state,
            nics: BTreeMap::new(),
            agent_hostname: None,
        }
    }
}

#[derive(Debug, Default)]
struct FakeHost {
    volumes: BTreeMap<String, FakeVolume>,
    domains: BTreeMap<String, FakeDomain>,
    free: u64,
    down: bool,
    /// Domains a wake does not change (paused again at once, as on an I/O error).
    stuck: BTreeSet<String>,
    /// The network of the host's bridge as a libvirt network declares it.
    bridge_net: Option<ipnet::Ipv4Net>,
}

/// How the fake "libvirt" reads a domain XML it is asked to define: the document it
/// stores and hands back as the inactive XML.
pub type Reading = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// An in-memory set of hosts: volumes with content, domains with state.
///
/// A define stores, and returns as libvirt's inactive XML, the fake's *reading* of the
/// document: the XML as given, unless a test sets another reading
/// ([`FakeOps::set_reading`]) to model libvirt reading a document differently from the
/// operator's checker. Every call is counted by operation ([`FakeOps::calls`]), so a test
/// can prove that a step (a start) never ran.
pub struct FakeOps {
    hosts: Mutex<BTreeMap<String, FakeHost>>,
    uploads: AtomicUsize,
    reading: Mutex<Option<Reading>>,
    calls: Mutex<BTreeMap<&'static str, usize>>,
}

impl std::fmt::Debug for FakeOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeOps")
            .field("hosts", &self.hosts)
            .field("uploads", &self.uploads)
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

impl FakeOps {
    /// Hosts with these names, each with `free` bytes in its pool.
    pub fn new(hosts: &[&str], free: u64) -> Self {
        Self {
            hosts: Mutex::new(
                hosts
                    .iter()
                    .map(|h| {
                        (
                            h.to_string(),
                            FakeHost {
                                free,
                                ..FakeHost::default()
                            },
                        )
                    })
                    .collect(),
            ),
            uploads: AtomicUsize::new(0),
            reading: Mutex::new(None),
            calls: Mutex::new(BTreeMap::new()),
        }
    }

    /// From now on, a define stores and returns `reading(xml)` instead of `xml`: what
    /// libvirt would have made of the document (its defaults added, or an attribute or
    /// element read differently from the checker).
    pub fn set_reading(&self, reading: impl Fn(&str) -> String + Send + Sync + 'static) {
        if let Ok(mut r) = self.reading.lock() {
            *r = Some(Arc::new(reading));
        }
    }

    /// How many calls of operation `op` (`domain-start`, `domain-define`, ...) reached a
    /// fake host, failed ones included.
    pub fn calls(&self, op: &str) -> usize {
        self.calls
            .lock()
            .ok()
            .and_then(|c| c.get(op).copied())
            .unwrap_or(0)
    }

    fn count(&self, op: &'static str) {
        if let Ok(mut c) = self.calls.lock() {
            *c.entry(op).or_insert(0) += 1;
        }
    }

    /// The XML stored for domain `name` (libvirt's reading at define), counted as `op`.
    fn stored_xml<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
        op: &'static str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        Box::pin(async move { self.with(host, op, |h| h.domains.get(name).map(|d| d.xml.clone())) })
    }

    fn with<T>(
        &self,
        host: &str,
        op: &'static str,
        f: impl FnOnce(&mut FakeHost) -> T,
    ) -> Result<T, OpsError> {
        self.count(op);
        let mut hosts = self
            .hosts
            .lock()
            .map_err(|_| injected(op, host, ErrorClass::Transient))?;
        match hosts.get_mut(host) {
            Some(h) if !h.down => Ok(f(h)),
            _ => Err(injected(op, host, ErrorClass::Transient)),
        }
    }

    /// Takes a host down (every call fails, transiently) or brings it back.
    pub fn set_down(&self, host: &str, down: bool) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(h) = hosts.get_mut(host)
        {
            h.down = down;
        }
    }

    /// Volume names on a host.
    pub fn volumes(&self, host: &str) -> BTreeSet<String> {
        self.hosts
            .lock()
            .ok()
            .and_then(|h| h.get(host).map(|h| h.volumes.keys().cloned().collect()))
            .unwrap_or_default()
    }

    /// Content of a volume.
    pub fn volume_data(&self, host: &str, name: &str) -> Option<Vec<u8>> {
        self.hosts
            .lock()
            .ok()?
            .get(host)?
            .volumes
            .get(name)
            .map(|v| v.data.clone())
    }

    /// Domain names on a host.
    pub fn domains(&self, host: &str) -> BTreeSet<String> {
        self.hosts
            .lock()
            .ok()
            .and_then(|h| h.get(host).map(|h| h.domains.keys().cloned().collect()))
            .unwrap_or_default()
    }

    /// Defines a domain directly (a foreign one, or a leftover).
    pub fn put_domain(&self, host: &str, name: &str, xml: &str, state: InstanceState) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(h) = hosts.get_mut(host)
        {
            // As `virsh define` over an existing domain: its UUID stays.
            let mut d = FakeDomain::new(xml.into(), state);
            if let Some(b) = h.domains.get(name) {
                d.uuid = b.uuid.clone();
            }
            h.domains.insert(name.into(), d);
        }
    }

    /// What address source `source` reports for domain `name` from now on.
    pub fn set_addresses(
        &self,
        host: &str,
        name: &str,
        source: AddressSource,
        nics: Vec<NicAddrs>,
    ) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(d) = hosts.get_mut(host).and_then(|h| h.domains.get_mut(name))
        {
            d.nics.insert(source, nics);
        }
    }

    /// The IPv4 network a libvirt network declares for `host`'s bridge from now on;
    /// `None`: no libvirt network owns the bridge.
    pub fn set_bridge_network(&self, host: &str, net: Option<ipnet::Ipv4Net>) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(h) = hosts.get_mut(host)
        {
            h.bridge_net = net;
        }
    }

    /// The host name domain `name`'s guest agent answers from now on; `None`: no agent.
    pub fn set_agent_hostname(&self, host: &str, name: &str, hostname: Option<&str>) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(d) = hosts.get_mut(host).and_then(|h| h.domains.get_mut(name))
        {
            d.agent_hostname = hostname.map(str::to_string);
        }
    }

    /// Creates a volume directly.
    pub fn put_volume(&self, host: &str, name: &str, data: &[u8]) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(h) = hosts.get_mut(host)
        {
            h.volumes.insert(
                name.into(),
                FakeVolume {
                    capacity: data.len() as u64,
                    data: data.to_vec(),
                    backing: None,
                },
            );
        }
    }

    /// Uploads that reached the end.
    pub fn uploads(&self) -> usize {
        self.uploads.load(Ordering::SeqCst)
    }

    /// Creates a volume directly, as an overlay over the volume `base` of the same pool.
    pub fn put_overlay(&self, host: &str, pool: &str, name: &str, base: &str) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(h) = hosts.get_mut(host)
        {
            h.volumes.insert(
                name.into(),
                FakeVolume {
                    capacity: 1 << 30,
                    data: Vec::new(),
                    backing: Some(fake_path(pool, base)),
                },
            );
        }
    }

    /// The state of domain `name`, if it exists.
    pub fn domain_state(&self, host: &str, name: &str) -> Option<InstanceState> {
        self.hosts
            .lock()
            .ok()?
            .get(host)?
            .domains
            .get(name)
            .map(|d| d.state)
    }

    /// Sets the state of domain `name` (paused, suspended, blocked, ... behind our back).
    pub fn set_state(&self, host: &str, name: &str, state: InstanceState) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(d) = hosts.get_mut(host).and_then(|h| h.domains.get_mut(name))
        {
            d.state = state;
        }
    }

    /// Makes a wake of domain `name` leave it as it is (a guest paused again at once).
    pub fn set_stuck(&self, host: &str, name: &str) {
        if let Ok(mut hosts) = self.hosts.lock()
            && let Some(h) = hosts.get_mut(host)
        {
            h.stuck.insert(name.into());
        }
    }
}

/// The path the fake reports for volume `name` of `pool`.
fn fake_path(pool: &str, name: &str) -> String {
    format!("/fake/{pool}/{name}")
}

fn injected(op: &'static str, host: &str, class: ErrorClass) -> OpsError {
    OpsError::Injected {
        op,
        host: host.to_string(),
        class,
    }
}

fn domain_name(xml: &str) -> Option<String> {
    let start = xml.find("<name>")? + "<name>".len();
    let end = xml[start..].find("</name>")? + start;
    Some(xml[start..end].to_string())
}

fn capacity(xml: &str) -> u64 {
    xml.find("'bytes'>")
        .and_then(|i| {
            let rest = &xml[i + "'bytes'>".len()..];
            rest[..rest.find('<')?].parse().ok()
        })
        .unwrap_or(0)
}

fn record(name: &str, d: &FakeDomain) -> DomainRecord {
    let mark = metadata::mark_from_domain_xml(&d.xml);
    DomainRecord {
        uuid: d.uuid.clone(),
        name: name.to_string(),
        state: d.state,
        damaged_mark: mark.is_err(),
        mark: mark.ok().flatten(),
    }
}

impl HostOps for FakeOps {
    fn hosts(&self) -> Vec<String> {
        self.hosts
            .lock()
            .map(|h| h.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn facts<'a>(&'a self, host: &'a str) -> BoxFuture<'a, Result<Facts, OpsError>> {
        // A big host, so the fakes' tests of CPU placement meet only the config's limits.
        Box::pin(async move {
            self.with(host, "host-facts", |_| Facts {
                cpus: 64,
                numa_nodes: 4,
                ..Facts::default()
            })
        })
    }

    fn pool_space<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
    ) -> BoxFuture<'a, Result<PoolSpace, OpsError>> {
        Box::pin(async move {
            self.with(host, "pool-info", |h| PoolSpace {
                capacity: h.free,
                available: h.free,
            })
        })
    }

    fn volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<VolumeInfo>, OpsError>> {
        Box::pin(async move {
            self.with(host, "volume-info", |h| {
                h.volumes.get(name).map(|v| VolumeInfo {
                    capacity: v.capacity,
                    allocation: v.data.len() as u64,
                    path: fake_path(pool, name),
                })
            })
        })
    }

    fn create_volume<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
        name: &'a str,
        xml: String,
    ) -> BoxFuture<'a, Result<Created, OpsError>> {
        Box::pin(async move {
            self.with(host, "volume-create", |h| {
                if h.volumes.contains_key(name) {
                    Created::Exists
                } else {
                    h.volumes.insert(
                        name.to_string(),
                        FakeVolume {
                            capacity: capacity(&xml),
                            data: Vec::new(),
                            backing: backing_path(&xml),
                        },
                    );
                    Created::Created
                }
            })
        })
    }

    fn resize_volume<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
        name: &'a str,
        capacity: u64,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.with(host, "volume-resize", |h| {
                h.volumes.get_mut(name).map(|v| v.capacity = capacity)
            })?
            .ok_or_else(|| injected("volume-resize", host, ErrorClass::NotFound))
        })
    }

    fn delete_volume<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, OpsError>> {
        Box::pin(
            async move { self.with(host, "volume-delete", |h| h.volumes.remove(name).is_some()) },
        )
    }

    fn upload<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
        name: &'a str,
        length: u64,
        mut chunks: UploadChunks,
        _deadline: Duration,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            let mut data = Vec::new();
            while let Some(chunk) = chunks.recv().await {
                match chunk {
                    Ok(c) => data.extend_from_slice(&c),
                    Err(reason) => {
                        return Err(OpsError::UploadAborted {
                            host: host.into(),
                            volume: name.into(),
                            reason,
                        });
                    }
                }
            }
            if data.len() as u64 != length {
                return Err(OpsError::UploadAborted {
                    host: host.into(),
                    volume: name.into(),
                    reason: format!("got {} of {length} bytes", data.len()),
                });
            }
            self.with(host, "volume-upload", |h| match h.volumes.get_mut(name) {
                Some(v) => {
                    v.data = data;
                    true
                }
                None => false,
            })?
            .then_some(())
            .ok_or_else(|| injected("volume-upload", host, ErrorClass::NotFound))?;
            self.uploads.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    fn read_volume<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
        name: &'a str,
        max_len: usize,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, OpsError>> {
        Box::pin(async move {
            self.with(host, "volume-read", |h| {
                h.volumes
                    .get(name)
                    .map(|v| v.data[..v.data.len().min(max_len)].to_vec())
            })
        })
    }

    fn write_volume<'a>(
        &'a self,
        host: &'a str,
        _pool: &'a str,
        name: &'a str,
        data: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.with(host, "volume-write", |h| {
                h.volumes.get_mut(name).map(|v| {
                    let end = data.len().max(v.data.len());
                    v.data.resize(end, 0);
                    v.data[..data.len()].copy_from_slice(&data);
                })
            })?
            .ok_or_else(|| injected("volume-write", host, ErrorClass::NotFound))
        })
    }

    fn domain<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<DomainRecord>, OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-lookup", |h| {
                h.domains.get(name).map(|d| record(name, d))
            })
        })
    }

    fn domain_xml<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        self.stored_xml(host, name, "domain-xml")
    }

    fn inactive_xml<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        // The fake stores libvirt's reading at define: live and inactive XML are the same.
        self.stored_xml(host, name, "domain-inactive-xml")
    }

    fn define<'a>(
        &'a self,
        host: &'a str,
        xml: String,
    ) -> BoxFuture<'a, Result<DefinedDomain, OpsError>> {
        Box::pin(async move {
            let reading = self.reading.lock().ok().and_then(|r| r.clone());
            let xml = match reading {
                Some(read) => read(&xml),
                None => xml,
            };
            let Some(name) = domain_name(&xml) else {
                self.count("domain-define");
                return Err(injected("domain-define", host, ErrorClass::Permanent));
            };
            self.with(host, "domain-define", |h| {
                let before = h.domains.get(&name);
                let state = before.map_or(InstanceState::ShutOff, |d| d.state);
                let mut d = FakeDomain::new(xml.clone(), state);
                if let Some(b) = before {
                    d.uuid = b.uuid.clone();
                }
                h.domains.insert(name.clone(), d);
                DefinedDomain {
                    name,
                    inactive_xml: xml,
                }
            })
        })
    }

    fn start<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-start", |h| match h.domains.get_mut(name) {
                Some(d) => {
                    d.state = InstanceState::Running;
                    Ok(())
                }
                None => Err(injected("domain-start", host, ErrorClass::NotFound)),
            })?
        })
    }

    fn shutdown<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-shutdown", |h| {
                if let Some(d) = h.domains.get_mut(name) {
                    d.state = InstanceState::ShutOff;
                }
            })
        })
    }

    fn destroy<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-destroy", |h| {
                if let Some(d) = h.domains.get_mut(name) {
                    d.state = InstanceState::ShutOff;
                }
            })
        })
    }

    fn undefine<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-undefine", |h| {
                h.domains.remove(name).is_some()
            })
        })
    }

    fn addresses<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
        source: AddressSource,
    ) -> BoxFuture<'a, Result<Vec<NicAddrs>, OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-addresses", |h| {
                h.domains
                    .get(name)
                    .and_then(|d| d.nics.get(&source).cloned())
                    .unwrap_or_default()
            })
        })
    }

    fn bridge_network<'a>(
        &'a self,
        host: &'a str,
        _bridge: &'a str,
    ) -> BoxFuture<'a, Result<Option<ipnet::Ipv4Net>, OpsError>> {
        Box::pin(async move { self.with(host, "network-list", |h| h.bridge_net) })
    }

    fn guest_hostname<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-hostname", |h| {
                h.domains
                    .get(name)
                    .filter(|d| d.state == InstanceState::Running)
                    .and_then(|d| d.agent_hostname.clone())
            })
        })
    }

    fn list_domains<'a>(
        &'a self,
        host: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DomainRecord>, OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-list", |h| {
                h.domains
                    .iter()
                    .filter(|(n, _)| n.starts_with(crate::instance::NAME_PREFIX))
                    .map(|(n, d)| record(n, d))
                    .collect()
            })
        })
    }

    fn list_domain_names<'a>(
        &'a self,
        host: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DomainName>, OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-names", |h| {
                h.domains
                    .iter()
                    .filter(|(n, _)| n.starts_with(crate::instance::NAME_PREFIX))
                    .map(|(n, d)| DomainName {
                        name: n.clone(),
                        uuid: d.uuid.clone(),
                    })
                    .collect()
            })
        })
    }

    fn wake<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.with(host, "domain-wake", |h| {
                let stuck = h.stuck.contains(name);
                if let Some(d) = h.domains.get_mut(name)
                    && !stuck
                    && matches!(d.state, InstanceState::Paused | InstanceState::Suspended)
                {
                    d.state = InstanceState::Running;
                }
            })
        })
    }

    fn list_volumes<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
    ) -> BoxFuture<'a, Result<Vec<VolumeEntry>, OpsError>> {
        Box::pin(async move {
            self.with(host, "volume-list", |h| {
                h.volumes
                    .iter()
                    .filter(|(n, _)| n.starts_with(crate::instance::NAME_PREFIX))
                    .map(|(n, v)| VolumeEntry {
                        name: n.clone(),
                        capacity: v.capacity,
                        path: fake_path(pool, n),
                        backing: v.backing.clone(),
                    })
                    .collect()
            })
        })
    }
}

/// Something a [`Hooked`] does around the operations it forwards.
///
/// Every method has a no-op default, so a test double says only what it changes and the
/// forwarding of the whole [`HostOps`] surface lives in one place.
pub trait OpHook: Send + Sync {
    /// Runs before operation `op` (`domain-define`, `volume-create`, ... as [`FakeOps`]
    /// counts them) on `host`, about `target` (the volume or domain named in the call,
    /// if any). An error is returned in place of the operation, which then never reaches
    /// the inner host; a future that never ends models a host that never answers.
    fn before<'a>(
        &'a self,
        op: &'static str,
        host: &'a str,
        target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        let _ = (op, host, target);
        Box::pin(std::future::ready(Ok(())))
    }

    /// The XML a define hands on, after [`OpHook::before`]: lets a test make "libvirt"
    /// see another document than the provider sent.
    fn define_xml(&self, xml: String) -> String {
        xml
    }

    /// Told of every volume create the inner host answered, with its answer.
    fn after_create_volume(&self, host: &str, name: &str, created: Created) {
        let _ = (host, name, created);
    }

    /// The chunks an upload hands on, after [`OpHook::before`]. `None` ends the upload
    /// with success without reaching the inner host (bytes written to a volume that is
    /// no longer there).
    fn upload_chunks<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
        chunks: UploadChunks,
    ) -> BoxFuture<'a, Option<UploadChunks>> {
        let _ = (host, name);
        Box::pin(std::future::ready(Some(chunks)))
    }
}

/// A [`HostOps`] that forwards every operation to `inner` through the hooks of `H`.
pub struct Hooked<H> {
    inner: Arc<dyn HostOps>,
    hook: H,
}

impl<H: std::fmt::Debug> std::fmt::Debug for Hooked<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked")
            .field("hook", &self.hook)
            .finish_non_exhaustive()
    }
}

impl<H: OpHook> Hooked<H> {
    /// `inner`'s operations, with `hook` around them.
    pub fn wrap(inner: Arc<dyn HostOps>, hook: H) -> Self {
        Self { inner, hook }
    }

    /// The hook, for what it recorded.
    pub fn hook(&self) -> &H {
        &self.hook
    }
}

/// Forwards one operation after its `before` hook.
macro_rules! hooked {
    ($self:ident, $op:literal, $host:expr, $target:expr, $call:expr) => {
        Box::pin(async move {
            $self.hook.before($op, $host, $target).await?;
            $call.await
        })
    };
}

impl<H: OpHook> HostOps for Hooked<H> {
    fn hosts(&self) -> Vec<String> {
        self.inner.hosts()
    }
    fn facts<'a>(&'a self, host: &'a str) -> BoxFuture<'a, Result<Facts, OpsError>> {
        hooked!(self, "host-facts", host, None, self.inner.facts(host))
    }
    fn pool_space<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
    ) -> BoxFuture<'a, Result<PoolSpace, OpsError>> {
        hooked!(
            self,
            "pool-info",
            host,
            None,
            self.inner.pool_space(host, pool)
        )
    }
    fn volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<VolumeInfo>, OpsError>> {
        hooked!(
            self,
            "volume-info",
            host,
            Some(name),
            self.inner.volume(host, pool, name)
        )
    }
    fn create_volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
        xml: String,
    ) -> BoxFuture<'a, Result<Created, OpsError>> {
        Box::pin(async move {
            self.hook.before("volume-create", host, Some(name)).await?;
            let created = self.inner.create_volume(host, pool, name, xml).await?;
            self.hook.after_create_volume(host, name, created);
            Ok(created)
        })
    }
    fn resize_volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
        capacity: u64,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        hooked!(
            self,
            "volume-resize",
            host,
            Some(name),
            self.inner.resize_volume(host, pool, name, capacity)
        )
    }
    fn delete_volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, OpsError>> {
        hooked!(
            self,
            "volume-delete",
            host,
            Some(name),
            self.inner.delete_volume(host, pool, name)
        )
    }
    fn upload<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
        length: u64,
        chunks: UploadChunks,
        deadline: Duration,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            self.hook.before("volume-upload", host, Some(name)).await?;
            match self.hook.upload_chunks(host, name, chunks).await {
                Some(chunks) => {
                    self.inner
                        .upload(host, pool, name, length, chunks, deadline)
                        .await
                }
                None => Ok(()),
            }
        })
    }
    fn read_volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
        max_len: usize,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, OpsError>> {
        hooked!(
            self,
            "volume-read",
            host,
            Some(name),
            self.inner.read_volume(host, pool, name, max_len)
        )
    }
    fn write_volume<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
        name: &'a str,
        data: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        hooked!(
            self,
            "volume-write",
            host,
            Some(name),
            self.inner.write_volume(host, pool, name, data)
        )
    }
    fn domain<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<DomainRecord>, OpsError>> {
        hooked!(
            self,
            "domain-lookup",
            host,
            Some(name),
            self.inner.domain(host, name)
        )
    }
    fn domain_xml<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        hooked!(
            self,
            "domain-xml",
            host,
            Some(name),
            self.inner.domain_xml(host, name)
        )
    }
    fn inactive_xml<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        hooked!(
            self,
            "domain-inactive-xml",
            host,
            Some(name),
            self.inner.inactive_xml(host, name)
        )
    }
    fn define<'a>(
        &'a self,
        host: &'a str,
        xml: String,
    ) -> BoxFuture<'a, Result<DefinedDomain, OpsError>> {
        hooked!(
            self,
            "domain-define",
            host,
            None,
            self.inner.define(host, self.hook.define_xml(xml))
        )
    }
    fn start<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        hooked!(
            self,
            "domain-start",
            host,
            Some(name),
            self.inner.start(host, name)
        )
    }
    fn shutdown<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        hooked!(
            self,
            "domain-shutdown",
            host,
            Some(name),
            self.inner.shutdown(host, name)
        )
    }
    fn destroy<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        hooked!(
            self,
            "domain-destroy",
            host,
            Some(name),
            self.inner.destroy(host, name)
        )
    }
    fn undefine<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, OpsError>> {
        hooked!(
            self,
            "domain-undefine",
            host,
            Some(name),
            self.inner.undefine(host, name)
        )
    }
    fn addresses<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
        source: AddressSource,
    ) -> BoxFuture<'a, Result<Vec<NicAddrs>, OpsError>> {
        hooked!(
            self,
            "domain-addresses",
            host,
            Some(name),
            self.inner.addresses(host, name, source)
        )
    }
    fn bridge_network<'a>(
        &'a self,
        host: &'a str,
        bridge: &'a str,
    ) -> BoxFuture<'a, Result<Option<ipnet::Ipv4Net>, OpsError>> {
        hooked!(
            self,
            "network-list",
            host,
            None,
            self.inner.bridge_network(host, bridge)
        )
    }
    fn guest_hostname<'a>(
        &'a self,
        host: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, OpsError>> {
        hooked!(
            self,
            "domain-hostname",
            host,
            Some(name),
            self.inner.guest_hostname(host, name)
        )
    }
    fn list_domains<'a>(
        &'a self,
        host: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DomainRecord>, OpsError>> {
        hooked!(
            self,
            "domain-list",
            host,
            None,
            self.inner.list_domains(host)
        )
    }
    fn list_domain_names<'a>(
        &'a self,
        host: &'a str,
    ) -> BoxFuture<'a, Result<Vec<DomainName>, OpsError>> {
        hooked!(
            self,
            "domain-names",
            host,
            None,
            self.inner.list_domain_names(host)
        )
    }
    fn wake<'a>(&'a self, host: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), OpsError>> {
        hooked!(
            self,
            "domain-wake",
            host,
            Some(name),
            self.inner.wake(host, name)
        )
    }
    fn list_volumes<'a>(
        &'a self,
        host: &'a str,
        pool: &'a str,
    ) -> BoxFuture<'a, Result<Vec<VolumeEntry>, OpsError>> {
        hooked!(
            self,
            "volume-list",
            host,
            None,
            self.inner.list_volumes(host, pool)
        )
    }
}

/// The operations [`FaultyOps`] can fail, by name.
pub const FAULT_POINTS: [&str; 7] = [
    "volume-create",
    "volume-upload",
    "domain-define",
    "domain-start",
    "domain-lookup",
    "volume-delete",
    "domain-undefine",
];

/// Wraps a [`HostOps`] and fails the `nth` call (0-based) of operation `op`.
///
/// With `crash`, every call after the fault fails too, as if the process had died there:
/// no cleanup runs, and the next provider must converge from what is left.
pub type FaultyOps = Hooked<Fault>;

/// The hook of [`FaultyOps`]: which call to fail, and whether it has.
#[derive(Debug)]
pub struct Fault {
    op: &'static str,
    nth: usize,
    crash: bool,
    seen: AtomicUsize,
    tripped: AtomicBool,
}

impl Fault {
    /// Fails the `nth` call of `op` (one of [`FAULT_POINTS`]).
    pub fn new(op: &'static str, nth: usize, crash: bool) -> Self {
        Self {
            op,
            nth,
            crash,
            seen: AtomicUsize::new(0),
            tripped: AtomicBool::new(false),
        }
    }

    /// Whether the fault fired.
    pub fn tripped(&self) -> bool {
        self.tripped.load(Ordering::SeqCst)
    }

    fn gate(&self, op: &'static str, host: &str) -> Result<(), OpsError> {
        if self.crash && self.tripped() {
            return Err(injected(op, host, ErrorClass::Transient));
        }
        if op == self.op && self.seen.fetch_add(1, Ordering::SeqCst) == self.nth {
            self.tripped.store(true, Ordering::SeqCst);
            return Err(injected(op, host, ErrorClass::Transient));
        }
        Ok(())
    }
}

impl OpHook for Fault {
    fn before<'a>(
        &'a self,
        op: &'static str,
        host: &'a str,
        _target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(std::future::ready(self.gate(op, host)))
    }
}

impl Hooked<Fault> {
    /// `inner`, failing the `nth` call of `op` (one of [`FAULT_POINTS`]).
    pub fn new(inner: Arc<dyn HostOps>, op: &'static str, nth: usize, crash: bool) -> Self {
        Self::wrap(inner, Fault::new(op, nth, crash))
    }

    /// Whether the fault fired.
    pub fn tripped(&self) -> bool {
        self.hook.tripped()
    }
}
