//! Discovery: per pool a selector-less Service and one EndpointSlice per address family
//! that list only the proxies serving now.
//!
//! - The Service is named after the pool, has no selector (kube-proxy takes its endpoints
//!   from our slices) and one TCP port, `proxy`, the proxy port (`serving.port`).
//! - The slices are `<pool>-ipv4` and `<pool>-ipv6`, labelled
//!   `kubernetes.io/service-name=<pool>` and `endpointslice.kubernetes.io/managed-by=`
//!   [`MANAGED_BY`]: one writer per slice, and kube's own EndpointSlice controller leaves
//!   them alone (the Service has no selector). Both always exist, possibly empty.
//! - A proxy is listed when it serves now ([`super::Member::serving`]: the fast probe's
//!   verdict, else `Ready`) and no lease holds it (a leased proxy serves its lease alone):
//!   `ready=serving=true, terminating=false`. A proxy the pool drains is listed
//!   `ready=false, serving=true, terminating=true` for the drain period while it still
//!   answers, so kube-proxy falls back on it when nothing ready is left. Only Proxies the
//!   pool controls count ([`super::membership`]). Anything else is not listed.
//! - Every object is written whole by server-side apply with force, so a hand edit is
//!   undone and a deleted object comes back at the next watch event (the controller owns
//!   them, so their events trigger the pool's reconcile).
//! - The same list goes to `ProxyPool.status.endpoints`; a change of membership is an
//!   Event on the pool, and the time from a proxy's first failing fast probe to the write
//!   that removed it is observed ([`super::FleetMetrics`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference};
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};

use crate::api::proxy::Proxy;
use crate::api::proxy_pool::{POOL_LABEL, PoolEndpoint, ProxyPool};
use crate::controller::status::set_condition;

use super::membership::made_by;
use super::pool::{FleetContext, board_changes, publish};
use super::split;
use super::{FIELD_MANAGER, FleetError, Member};

/// `endpointslice.kubernetes.io/managed-by` of our slices.
pub const MANAGED_BY: &str = "discovery.egress-operator.dev";
/// Label kube-proxy reads to tie a slice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Label naming a slice's writer.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// The Service's port name.
pub const PORT_NAME: &str = "proxy";
/// The pool condition discovery owns: True while the liveness guard holds the endpoints.
pub const ENDPOINTS_HELD: &str = "EndpointsHeld";
/// The pool condition that says whether discovery could write the pool's Service.
pub const SERVICE_READY: &str = "ServiceReady";
/// `ServiceReady` reason: a Service (or slice) of the pool's name belongs to someone else.
pub const SERVICE_CONFLICT: &str = "ServiceConflict";
/// Field manager of discovery's pool status writes (the pool controller has its own).
const STATUS_MANAGER: &str = "egress-operator-discovery";
/// Resync of a pool that nothing triggers.
const RESYNC: Duration = Duration::from_secs(60);
/// Longest pool name: the slices append `-ipv4`/`-ipv6`, and a Service name is a DNS-1035
/// label of at most 63 characters.
const MAX_POOL_NAME: usize = 58;

/// A listed proxy with the UID its slice entry points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// What status shows.
    pub endpoint: PoolEndpoint,
    /// The Proxy's UID.
    pub uid: String,
    /// Its address, parsed.
    pub ip: IpAddr,
}

/// The proxies to list, by name.
pub fn listed(members: &[Member], port: u16) -> Vec<Listed> {
    let mut out: Vec<Listed> = members
        .iter()
        .filter(|m| m.serving && !m.deleting)
        .filter_map(|m| {
            let ip = m.address?;
            let draining = m.draining_since.is_some();
            Some(Listed {
                endpoint: PoolEndpoint {
                    proxy: m.name.clone(),
                    address: ip.to_string(),
                    port: i32::from(port),
                    host: m.host.clone(),
                    ready: !draining,
                    terminating: draining,
                },
                uid: m.uid.clone(),
                ip,
            })
        })
        .collect();
    out.sort_by(|a, b| a.endpoint.proxy.cmp(&b.endpoint.proxy));
    out
}

/// What the pool's Service lists: [`listed`] without the leased members. A leased proxy
/// serves its lease alone (the lease's own Service lists it), so anyone using the pool's
/// Service must never leave through it.
pub fn pool_listed(members: &[Member], port: u16) -> Vec<Listed> {
    let unleased: Vec<Member> = members.iter().filter(|m| !m.leased).cloned().collect();
    listed(&unleased, port)
}

/// The owner reference our objects carry.
pub fn owner_of(pool: &ProxyPool) -> Option<OwnerReference> {
    pool.controller_owner_ref(&())
}

/// The pool's Service.
pub fn service(pool: &str, namespace: &str, owner: &OwnerReference, port: u16) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(pool.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(POOL_LABEL.to_string(), pool.to_string())])),
            owner_references: Some(vec![owner.clone()]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                name: Some(PORT_NAME.into()),
                protocol: Some("TCP".into()),
                port: i32::from(port),
                target_port: Some(
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port)),
                ),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The address families: the slice's `addressType`, its name's suffix, IPv6 or not.
const FAMILIES: [(&str, &str, bool); 2] = [("IPv4", "ipv4", false), ("IPv6", "ipv6", true)];

/// Two EndpointSlices (IPv4, IPv6), each listing its family's proxies: a lease's (it holds
/// at most 16). A pool's may need more ([`pool_slices`]).
pub fn slices(
    pool: &str,
    namespace: &str,
    owner: &OwnerReference,
    port: u16,
    listed: &[Listed],
) -> Vec<EndpointSlice> {
    FAMILIES
        .into_iter()
        .map(|(family, suffix, v6)| {
            let of_family: Vec<&Listed> = listed.iter().filter(|l| l.ip.is_ipv6() == v6).collect();
            let name = split::slice_name(pool, suffix, 0);
            slice(pool, namespace, owner, port, (family, &name), &of_family)
        })
        .collect()
}

/// The pool's EndpointSlices: per family at most [`split::MAX_ENDPOINTS_PER_SLICE`]
/// endpoints a slice, placed as [`split::place`] says given the slices `seen` now. The
/// family's first slice is always there; a seen slice that is not returned is surplus.
pub fn pool_slices(
    pool: &str,
    namespace: &str,
    owner: &OwnerReference,
    port: u16,
    listed: &[Listed],
    seen: &[Arc<EndpointSlice>],
) -> Vec<EndpointSlice> {
    let mut out = Vec::new();
    for (family, suffix, v6) in FAMILIES {
        let of_family: Vec<&Listed> = listed.iter().filter(|l| l.ip.is_ipv6() == v6).collect();
        let keys: Vec<String> = of_family.iter().map(|l| l.uid.clone()).collect();
        let by_uid: HashMap<&str, &Listed> =
            of_family.iter().map(|l| (l.uid.as_str(), *l)).collect();
        let now: BTreeMap<usize, Vec<String>> = seen
            .iter()
            .filter(|s| s.address_type == family)
            .filter_map(|s| {
                let i = split::slice_index(pool, suffix, s.metadata.name.as_deref()?)?;
                let uids = s
                    .endpoints
                    .iter()
                    .filter_map(|e| e.target_ref.as_ref()?.uid.clone())
                    .collect();
                Some((i, uids))
            })
            .collect();
        for (i, uids) in split::place(&keys, &now, split::MAX_ENDPOINTS_PER_SLICE) {
            let members: Vec<&Listed> = uids
                .iter()
                .filter_map(|u| by_uid.get(u.as_str()).copied())
                .collect();
            let name = split::slice_name(pool, suffix, i);
            out.push(slice(
                pool,
                namespace,
                owner,
                port,
                (family, &name),
                &members,
            ));
        }
    }
    out
}

/// One slice of `family` named `name`, listing `listed`.
fn slice(
    pool: &str,
    namespace: &str,
    owner: &OwnerReference,
    port: u16,
    (family, name): (&str, &str),
    listed: &[&Listed],
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (SERVICE_NAME_LABEL.to_string(), pool.to_string()),
                (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
                (POOL_LABEL.to_string(), pool.to_string()),
            ])),
            owner_references: Some(vec![owner.clone()]),
            ..Default::default()
        },
        address_type: family.into(),
        ports: Some(vec![EndpointPort {
            name: Some(PORT_NAME.into()),
            protocol: Some("TCP".into()),
            port: Some(i32::from(port)),
            app_protocol: None,
        }]),
        endpoints: listed
            .iter()
            .map(|l| Endpoint {
                addresses: vec![l.ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(l.endpoint.ready),
                    // Only proxies that answer are listed: a draining one still
                    // serves (kube-proxy's serving-but-terminating fallback).
                    serving: Some(true),
                    terminating: Some(l.endpoint.terminating),
                }),
                target_ref: Some(ObjectReference {
                    api_version: Some(Proxy::api_version(&()).into()),
                    kind: Some(Proxy::kind(&()).into()),
                    name: Some(l.endpoint.proxy.clone()),
                    namespace: Some(namespace.into()),
                    uid: Some(l.uid.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
    }
}

/// Checks that the pool's name can name its Service (a DNS-1035 label) and slices.
pub fn check_name(name: &str) -> Result<(), FleetError> {
    let bad = |why| {
        Err(FleetError::BadName {
            name: name.into(),
            why,
        })
    };
    if name.len() > MAX_POOL_NAME {
        return bad("longer than 58 characters, so `<pool>-ipv4` is no valid object name");
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return bad("must start with a lowercase letter to name a Service (DNS-1035)");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        || name.ends_with('-')
    {
        return bad("must be a DNS-1035 label to name a Service");
    }
    Ok(())
}

/// What changed in the list, for events: (proxy, what).
pub fn membership_changes(
    before: &[PoolEndpoint],
    after: &[PoolEndpoint],
) -> Vec<(String, String)> {
    let old: BTreeMap<&str, &PoolEndpoint> = before.iter().map(|e| (e.proxy.as_str(), e)).collect();
    let new: BTreeMap<&str, &PoolEndpoint> = after.iter().map(|e| (e.proxy.as_str(), e)).collect();
    let mut out = Vec::new();
    for (name, e) in &new {
        match old.get(name) {
            None if e.ready => out.push((name.to_string(), format!("added {}", e.address))),
            None => out.push((
                name.to_string(),
                format!("listed {} terminating", e.address),
            )),
            Some(o) if o.ready && !e.ready => out.push((
                name.to_string(),
                format!("{} is draining (terminating)", e.address),
            )),
            Some(o) if !o.ready && e.ready => {
                out.push((name.to_string(), format!("{} is ready again", e.address)))
            }
            Some(o) if o.address != e.address => out.push((
                name.to_string(),
                format!("address {} replaced by {}", o.address, e.address),
            )),
            Some(_) => {}
        }
    }
    for (name, o) in &old {
        if !new.contains_key(name) {
            out.push((name.to_string(), format!("removed {}", o.address)));
        }
    }
    out
}

/// What discovery reconciles with: the fleet's context and the Services and slices it
/// last saw (its own watches), so an object that already says what it should is not
/// written again.
#[derive(Debug)]
pub struct Discovery {
    fleet: Arc<FleetContext>,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    /// The pool-labelled Proxies: a reconcile reads them here, not from the API server
    /// (every verdict change reconciles every pool).
    proxies: super::cache::Cache<Proxy>,
}

impl Discovery {
    /// The pool's slices as last seen: ours (the pool's controller reference) in `ns`,
    /// for the pool's Service.
    fn our_slices(&self, ns: &str, pool: &str, pool_uid: &str) -> Vec<Arc<EndpointSlice>> {
        self.slices
            .state()
            .into_iter()
            .filter(|s| s.metadata.namespace.as_deref() == Some(ns))
            .filter(|s| s.labels().get(SERVICE_NAME_LABEL).map(String::as_str) == Some(pool))
            .filter(|s| {
                s.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && o.uid == pool_uid)
            })
            .collect()
    }

    /// The Proxy UIDs the pool's slices list now (what the operator accepted before).
    fn listed_uids(&self, ns: &str, pool: &str, pool_uid: &str) -> HashSet<String> {
        self.our_slices(ns, pool, pool_uid)
            .iter()
            .flat_map(|s| s.endpoints.iter())
            .filter_map(|e| e.target_ref.as_ref()?.uid.clone())
            .collect()
    }
}

/// Whether the Service seen says what `want` says in the fields we own: our labels and
/// owner, no selector, our port. Fields the API server fills in (cluster IP, families,
/// policies) are not ours and not compared.
pub fn service_current(seen: Option<&Service>, want: &Service) -> bool {
    let Some(seen) = seen.filter(|s| s.metadata.deletion_timestamp.is_none()) else {
        return false;
    };
    let port = |p: &ServicePort| {
        (
            p.name.clone(),
            p.protocol.clone(),
            p.port,
            p.target_port.clone(),
        )
    };
    let ports = |s: &Service| -> Vec<_> {
        s.spec
            .as_ref()
            .and_then(|sp| sp.ports.as_ref())
            .map(|ps| ps.iter().map(port).collect())
            .unwrap_or_default()
    };
    let no_selector = seen
        .spec
        .as_ref()
        .and_then(|sp| sp.selector.as_ref())
        .is_none_or(BTreeMap::is_empty);
    meta_current(&seen.metadata, &want.metadata) && no_selector && ports(seen) == ports(want)
}

/// Whether the EndpointSlice seen lists exactly what `want` lists, with our labels and
/// owner.
pub fn slice_current(seen: Option<&EndpointSlice>, want: &EndpointSlice) -> bool {
    let Some(seen) = seen.filter(|s| s.metadata.deletion_timestamp.is_none()) else {
        return false;
    };
    let endpoint = |e: &Endpoint| {
        (
            e.addresses.clone(),
            e.conditions.clone(),
            e.target_ref.as_ref().and_then(|r| r.uid.clone()),
        )
    };
    let endpoints = |s: &EndpointSlice| -> Vec<_> { s.endpoints.iter().map(endpoint).collect() };
    meta_current(&seen.metadata, &want.metadata)
        && seen.address_type == want.address_type
        && seen.ports == want.ports
        && endpoints(seen) == endpoints(want)
}

/// Our labels are all there with our values, and our owner reference is.
fn meta_current(seen: &ObjectMeta, want: &ObjectMeta) -> bool {
    let labels_ok = want.labels.iter().flatten().all(|(k, v)| {
        seen.labels
            .as_ref()
            .and_then(|l| l.get(k))
            .is_some_and(|x| x == v)
    });
    let owner_ok = want.owner_references.iter().flatten().all(|o| {
        seen.owner_references
            .iter()
            .flatten()
            .any(|x| x.uid == o.uid && x.controller == o.controller)
    });
    labels_ok && owner_ok
}

/// Whether `meta` names the pool (`pool_uid`) as its controller.
fn controlled(meta: &ObjectMeta, pool_uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == pool_uid)
}

/// Why the pool's Service or slices cannot be written: an object of their name that the
/// pool does not control. The stores hold only objects with our labels, so a name they do
/// not know is read from the API server (a user's Service, a lease's Service). Also says
/// whether the Service exists.
async fn find_conflict(
    services: &Api<Service>,
    slices: &Api<EndpointSlice>,
    discovery: &Discovery,
    (ns, pool, pool_uid): (&str, &str, &str),
    want: &[EndpointSlice],
) -> Result<(Option<String>, bool), kube::Error> {
    let seen = match discovery.services.get(&ObjectRef::new(pool).within(ns)) {
        Some(s) => Some(s.metadata.clone()),
        None => services.get_metadata_opt(pool).await?.map(|m| m.metadata),
    };
    let exists = seen.is_some();
    if let Some(meta) = seen
        && !controlled(&meta, pool_uid)
    {
        return Ok((
            Some(format!(
                "Service {pool} exists and does not belong to this pool (a user's or a lease's \
             Service of that name?); rename or remove it, or rename the pool"
            )),
            exists,
        ));
    }
    for s in want {
        let sname = s.metadata.name.clone().unwrap_or_default();
        let seen = match discovery.slices.get(&ObjectRef::new(&sname).within(ns)) {
            Some(s) => Some(s.metadata.clone()),
            None => slices.get_metadata_opt(&sname).await?.map(|m| m.metadata),
        };
        if let Some(meta) = seen
            && !controlled(&meta, pool_uid)
        {
            return Ok((
                Some(format!(
                    "EndpointSlice {sname} exists and does not belong to this pool; rename or \
                 remove it, or rename the pool"
                )),
                exists,
            ));
        }
    }
    Ok((None, exists))
}

/// One reconcile of one pool's discovery objects.
async fn reconcile(pool: Arc<ProxyPool>, discovery: Arc<Discovery>) -> Result<Action, FleetError> {
    let ctx = &discovery.fleet;
    if !ctx.leading() {
        return Ok(Action::await_change());
    }
    let ns = pool
        .namespace()
        .ok_or(FleetError::Incomplete("metadata.namespace"))?;
    let name = pool.name_any();
    if pool.metadata.deletion_timestamp.is_some() {
        // Garbage collection removes what the pool owns.
        return Ok(Action::await_change());
    }
    check_name(&name)?;
    let owner = owner_of(&pool).ok_or(FleetError::Incomplete("metadata.uid"))?;
    // Not listed yet: an empty store must not empty the pool's slices.
    let Some(proxies) = discovery.proxies.labelled_for(&ns, &name) else {
        return Ok(Action::requeue(super::cache::NOT_FILLED_RETRY));
    };
    // Only Proxies the operator made for this pool: anyone allowed to create Proxies can
    // copy the label and the owner reference.
    let listed_now = discovery.listed_uids(&ns, &name, &owner.uid);
    let members: Vec<Member> = proxies
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| made_by(&pool, p, &listed_now))
        .map(|p| Member::of(p, &ctx.board))
        .collect();
    let port = ctx.port;
    let list = pool_listed(&members, port);
    // Forced only over objects this pool controls (a hand edit is undone); an object of
    // the same name that someone else owns is never written.
    let params = PatchParams::apply(FIELD_MANAGER)
        .force()
        .validation_strict();

    // Written only when what was last seen differs: at rest, a reconcile writes nothing.
    // A deleted or hand-edited object is seen so by the watch, and put back.
    let svc = service(&name, &ns, &owner, port);
    let svc_api = Api::<Service>::namespaced(ctx.client.clone(), &ns);
    let slice_api = Api::<EndpointSlice>::namespaced(ctx.client.clone(), &ns);
    let ours = discovery.our_slices(&ns, &name, &owner.uid);
    let want_slices = pool_slices(&name, &ns, &owner, port, &list, &ours);
    let (conflict, exists) = find_conflict(
        &svc_api,
        &slice_api,
        &discovery,
        (&ns, &name, &owner.uid),
        &want_slices,
    )
    .await?;
    if conflict.is_none() {
        let seen = discovery.services.get(&ObjectRef::new(&name).within(&ns));
        if !exists {
            // A create, not a forced apply: a Service someone made in the meantime is not
            // taken over (409, retried, and then seen as theirs).
            let create = PostParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            };
            svc_api.create(&create, &svc).await?;
        } else if !service_current(seen.as_deref(), &svc) {
            svc_api.patch(&name, &params, &Patch::Apply(&svc)).await?;
        }
    }
    // Under a conflict, our own slices (from before it) are emptied: kube-proxy would
    // feed them to the other Service of the pool's name.
    let write_slices = match conflict {
        None => want_slices,
        Some(_) => pool_slices(&name, &ns, &owner, port, &[], &ours)
            .into_iter()
            .filter(|s| {
                let sname = s.metadata.name.clone().unwrap_or_default();
                discovery
                    .slices
                    .get(&ObjectRef::new(&sname).within(&ns))
                    .is_some_and(|seen| controlled(&seen.metadata, &owner.uid))
            })
            .collect(),
    };
    for s in &write_slices {
        let sname = s.metadata.name.clone().unwrap_or_default();
        let seen = discovery.slices.get(&ObjectRef::new(&sname).within(&ns));
        if !slice_current(seen.as_deref(), s) {
            slice_api.patch(&sname, &params, &Patch::Apply(s)).await?;
        }
    }
    // Our slices no longer needed (a scale-in packed the rest, or a conflict): deleted,
    // each only as the object we saw (its UID).
    for s in &ours {
        let sname = s.metadata.name.clone().unwrap_or_default();
        if write_slices
            .iter()
            .any(|w| w.metadata.name.as_deref() == Some(sname.as_str()))
        {
            continue;
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: s.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match slice_api.delete(&sname, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }

    let before = pool
        .status
        .as_ref()
        .map(|s| s.endpoints.clone())
        .unwrap_or_default();
    let after: Vec<PoolEndpoint> = list.iter().map(|l| l.endpoint.clone()).collect();
    for m in &members {
        let was = before.iter().any(|e| e.proxy == m.name && e.ready);
        let is = after.iter().any(|e| e.proxy == m.name && e.ready);
        if was
            && !is
            && let Some(since) = ctx.board.take_failing_since(&m.uid)
        {
            ctx.metrics.removed_after(since.elapsed().as_secs_f64());
        }
    }
    let held = ctx.board.held();
    let mut conditions: Vec<Condition> = pool
        .status
        .as_ref()
        .map(|s| {
            s.conditions
                .iter()
                .filter(|c| c.type_ == ENDPOINTS_HELD || c.type_ == SERVICE_READY)
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let was_conflict = conditions
        .iter()
        .any(|c| c.type_ == SERVICE_READY && c.reason == SERVICE_CONFLICT);
    set_condition(
        &mut conditions,
        SERVICE_READY,
        conflict.is_none(),
        if conflict.is_some() {
            SERVICE_CONFLICT
        } else {
            "Written"
        },
        conflict
            .as_deref()
            .unwrap_or("the Service and its EndpointSlices are the pool's"),
        pool.metadata.generation,
        ctx.now(),
    );
    if let Some(why) = &conflict
        && !was_conflict
    {
        publish(
            ctx,
            &pool,
            EventType::Warning,
            SERVICE_CONFLICT,
            "Discovery",
            why.clone(),
        )
        .await;
    }
    let (reason, message) = if held {
        (
            "AllProbesFailed",
            "every pool proxy failed the fast probe at once; the last known endpoints are kept \
             until one passes (the operator's own network path is suspect)",
        )
    } else {
        ("ProbesPass", "endpoints follow the fast probe")
    };
    set_condition(
        &mut conditions,
        ENDPOINTS_HELD,
        held,
        reason,
        message,
        pool.metadata.generation,
        ctx.now(),
    );
    let shown = |type_: &str| {
        pool.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    let now_is = |type_: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    let status_changed = before != after
        || shown(ENDPOINTS_HELD).map(|(s, _)| s) != now_is(ENDPOINTS_HELD).map(|(s, _)| s)
        || shown(SERVICE_READY) != now_is(SERVICE_READY);
    if status_changed {
        let body = serde_json::json!({
            "apiVersion": ProxyPool::api_version(&()),
            "kind": ProxyPool::kind(&()),
            "metadata": { "name": name, "namespace": ns },
            "status": { "endpoints": after, "conditions": conditions },
        });
        let api = Api::<ProxyPool>::namespaced(ctx.client.clone(), &ns);
        let applied = crate::status_apply::apply_status(
            &api,
            &name,
            STATUS_MANAGER,
            &body,
            serde_json::to_value(&pool.status).ok().as_ref(),
        )
        .await?;
        super::pool::skewed(ctx, &pool, &applied).await;
    }
    for (proxy, what) in membership_changes(&before, &after) {
        publish(
            ctx,
            &pool,
            EventType::Normal,
            "EndpointsChanged",
            "Discovery",
            format!("{proxy}: {what}"),
        )
        .await;
    }
    let serving = after.iter().filter(|e| e.ready).count();
    let terminating = after.iter().filter(|e| e.terminating).count();
    let not = members.len().saturating_sub(serving + terminating);
    ctx.metrics.endpoints(&ns, &name, serving, terminating, not);
    Ok(Action::requeue(RESYNC))
}

fn error_policy(pool: Arc<ProxyPool>, error: &FleetError, _ctx: Arc<Discovery>) -> Action {
    tracing::warn!(pool = %pool.name_any(), error = %error, "discovery reconcile failed");
    Action::requeue(match error {
        FleetError::BadName { .. } => RESYNC,
        _ => Duration::from_secs(2),
    })
}

/// Runs discovery until `shutdown`: pools, their Proxies, Services and slices (ours, by
/// label) and every change of the fast probe's verdicts trigger a reconcile.
pub async fn run<F>(ctx: Arc<FleetContext>, shutdown: F)
where
    F: std::future::Future<Output = ()> + Send + Sync + 'static,
{
    let client = ctx.client.clone();
    // The Services and slices are reflected, so a reconcile can compare before it writes;
    // their deletions trigger the owner's reconcile as much as their changes.
    let (services, services_writer) = reflector::store();
    let service_events = watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(POOL_LABEL).any_semantic(),
    )
    .default_backoff()
    .reflect(services_writer)
    .touched_objects();
    let (slices, slices_writer) = reflector::store();
    let slice_events = watcher(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default()
            .labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"))
            .any_semantic(),
    )
    .default_backoff()
    .reflect(slices_writer)
    .touched_objects();
    let (proxies, proxy_events) = super::cache::pool_proxies(client.clone());
    let board = ctx.board.clone();
    let discovery = Arc::new(Discovery {
        fleet: ctx,
        services,
        slices,
        proxies,
    });
    let (reader, writer) = reflector::store();
    let pools = super::events::<ProxyPool>(client.clone(), discovery.fleet.metrics.watch.clone())
        .reflect(writer)
        .applied_objects();
    Controller::for_stream(pools, reader)
        .owns_stream(proxy_events)
        .owns_stream(service_events)
        .owns_stream(slice_events)
        .reconcile_all_on(board_changes(&board))
        .with_config(super::controller_config())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, discovery)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "discovery stream");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, ip: &str, serving: bool) -> Member {
        Member {
            name: name.into(),
            uid: format!("uid-{name}"),
            address: Some(ip.parse().unwrap()),
            host: Some("h1".into()),
            created: jiff::Timestamp::UNIX_EPOCH,
            template_hash: Some("t".into()),
            draining_since: None,
            leased: false,
            deleting: false,
            ready: serving,
            serving,
            failed: false,
            not_serving_since: None,
            outdated: false,
        }
    }

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "egress-operator.dev/v1alpha1".into(),
            kind: "ProxyPool".into(),
            name: "office".into(),
            uid: "pool-uid".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    #[test]
    fn only_serving_proxies_are_listed_and_draining_ones_as_terminating() {
        let mut draining = member("c", "192.0.2.3", true);
        draining.draining_since = Some(jiff::Timestamp::UNIX_EPOCH);
        let mut deleting = member("e", "192.0.2.5", true);
        deleting.deleting = true;
        let mut no_address = member("f", "192.0.2.6", true);
        no_address.address = None;
        let members = [
            member("b", "192.0.2.2", true),
            member("a", "2001:db8::1", true),
            draining,
            member("d", "192.0.2.4", false),
            deleting,
            no_address,
        ];
        let l = listed(&members, 3128);
        let names: Vec<&str> = l.iter().map(|l| l.endpoint.proxy.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);

        let s = slices("office", "ns", &owner(), 3128, &l);
        assert_eq!(s.len(), 2);
        let (v4, v6) = (&s[0], &s[1]);
        assert_eq!(v4.metadata.name.as_deref(), Some("office-ipv4"));
        assert_eq!(v4.address_type, "IPv4");
        assert_eq!(v6.address_type, "IPv6");
        let labels = v4.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[SERVICE_NAME_LABEL], "office");
        assert_eq!(labels[MANAGED_BY_LABEL], MANAGED_BY);
        let conds = |e: &Endpoint| {
            let c = e.conditions.clone().unwrap();
            (c.ready.unwrap(), c.serving.unwrap(), c.terminating.unwrap())
        };
        assert_eq!(v4.endpoints.len(), 2);
        assert_eq!(v4.endpoints[0].addresses, ["192.0.2.2"]);
        assert_eq!(conds(&v4.endpoints[0]), (true, true, false));
        assert_eq!(v4.endpoints[1].addresses, ["192.0.2.3"]);
        assert_eq!(conds(&v4.endpoints[1]), (false, true, true));
        assert_eq!(
            v4.endpoints[1].target_ref.as_ref().unwrap().uid.as_deref(),
            Some("uid-c")
        );
        assert_eq!(v6.endpoints.len(), 1);
        assert_eq!(v6.endpoints[0].addresses, ["2001:db8::1"]);
        assert_eq!(v4.ports.as_ref().unwrap()[0].port, Some(3128));
        assert_eq!(v4.metadata.owner_references.as_ref().unwrap()[0], owner());
    }

    #[test]
    fn the_pools_service_never_lists_a_leased_proxy() {
        let mut leased = member("b", "192.0.2.2", true);
        leased.leased = true;
        let mut leased_draining = member("c", "192.0.2.3", true);
        leased_draining.leased = true;
        leased_draining.draining_since = Some(jiff::Timestamp::UNIX_EPOCH);
        let members = [member("a", "192.0.2.1", true), leased, leased_draining];
        let names: Vec<String> = pool_listed(&members, 3128)
            .into_iter()
            .map(|l| l.endpoint.proxy)
            .collect();
        assert_eq!(names, ["a"]);
    }

    #[test]
    fn the_service_has_no_selector_and_the_proxy_port() {
        let s = service("office", "ns", &owner(), 8888);
        let spec = s.spec.unwrap();
        assert!(spec.selector.is_none());
        let p = &spec.ports.unwrap()[0];
        assert_eq!((p.name.as_deref(), p.port), (Some(PORT_NAME), 8888));
    }

    #[test]
    fn only_a_service_or_slice_that_differs_in_our_fields_is_written_again() {
        let want = service("office", "ns", &owner(), 3128);
        assert!(
            !service_current(None, &want),
            "a missing Service is written"
        );
        // The API server fills in fields that are not ours: still current.
        let mut seen = want.clone();
        let spec = seen.spec.as_mut().unwrap();
        spec.cluster_ip = Some("10.96.0.7".into());
        spec.type_ = Some("ClusterIP".into());
        seen.metadata.resource_version = Some("42".into());
        assert!(service_current(Some(&seen), &want));
        let mut edited = seen.clone();
        edited.spec.as_mut().unwrap().selector =
            Some(BTreeMap::from([("app".to_string(), "x".to_string())]));
        assert!(
            !service_current(Some(&edited), &want),
            "a hand-added selector"
        );
        let mut edited = seen.clone();
        edited.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 80;
        assert!(!service_current(Some(&edited), &want), "a changed port");
        let mut edited = seen.clone();
        edited.metadata.labels = None;
        assert!(!service_current(Some(&edited), &want), "our label removed");
        let mut edited = seen;
        edited.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        assert!(!service_current(Some(&edited), &want), "being deleted");

        let list = listed(&[member("a", "192.0.2.1", true)], 3128);
        let want = slices("office", "ns", &owner(), 3128, &list).remove(0);
        assert!(!slice_current(None, &want));
        let mut seen = want.clone();
        seen.metadata.generation = Some(3);
        assert!(slice_current(Some(&seen), &want));
        let mut edited = seen.clone();
        edited.endpoints[0].conditions.as_mut().unwrap().ready = Some(false);
        assert!(!slice_current(Some(&edited), &want), "a changed condition");
        let mut edited = seen.clone();
        edited.endpoints.clear();
        assert!(!slice_current(Some(&edited), &want), "an emptied slice");
        let mut edited = seen;
        edited.metadata.owner_references = None;
        assert!(!slice_current(Some(&edited), &want), "our owner removed");
    }

    #[test]
    fn names_that_cannot_name_a_service_are_refused() {
        assert!(check_name("office-pool").is_ok());
        for bad in ["1pool", "Pool", "pool-", &"p".repeat(59), "a.b"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn membership_changes_name_each_proxy_once() {
        let e = |n: &str, ready: bool| PoolEndpoint {
            proxy: n.into(),
            address: "192.0.2.1".into(),
            port: 3128,
            host: None,
            ready,
            terminating: !ready,
        };
        let c = membership_changes(
            &[e("a", true), e("b", true)],
            &[e("b", false), e("c", true)],
        );
        let names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["b", "c", "a"]);
        assert!(c[0].1.contains("draining"));
        assert!(c[2].1.contains("removed"));
        assert!(membership_changes(&[e("a", true)], &[e("a", true)]).is_empty());
    }
}
