//! A lease's own Service: named after the lease, no selector, one TCP port (the proxy
//! port), and two EndpointSlices (`<lease>-ipv4`, `<lease>-ipv6`) listing the bound
//! proxies that serve. A workload uses `http://<lease>.<namespace>.svc:<port>` and a
//! rebind changes only what the slices list. The shapes are discovery's
//! ([`super::super::discovery`]); only the labels differ, so the pool's discovery never
//! takes them for a pool's.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use crate::api::proxy_lease::LEASE_SERVICE_LABEL;

use super::super::discovery::{
    self, Listed, MANAGED_BY, MANAGED_BY_LABEL, SERVICE_NAME_LABEL, listed,
};
use super::super::{FIELD_MANAGER, Member};

/// Whether the lease's Service can be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceState {
    /// Written.
    Ready,
    /// An object the lease does not own already has the name.
    Conflict(String),
}

/// The lease's Service.
pub fn service(lease: &str, namespace: &str, owner: &OwnerReference, port: u16) -> Service {
    let mut s = discovery::service(lease, namespace, owner, port);
    s.metadata.labels = Some(BTreeMap::from([(
        LEASE_SERVICE_LABEL.to_string(),
        lease.to_string(),
    )]));
    s
}

/// The lease's two slices, listing `bound` proxies that serve now.
pub fn slices(
    lease: &str,
    namespace: &str,
    owner: &OwnerReference,
    port: u16,
    bound: &[Member],
) -> Vec<EndpointSlice> {
    // A bound proxy the pool started draining is not the lease's to offer any more.
    let serving: Vec<Listed> = listed(bound, port)
        .into_iter()
        .filter(|l| l.endpoint.ready)
        .collect();
    let mut out = discovery::slices(lease, namespace, owner, port, &serving);
    for s in &mut out {
        s.metadata.labels = Some(BTreeMap::from([
            (SERVICE_NAME_LABEL.to_string(), lease.to_string()),
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
            (LEASE_SERVICE_LABEL.to_string(), lease.to_string()),
        ]));
    }
    out
}

/// Writes the Service and slices where they differ from what they should say (server-side
/// apply, forced: one writer, hand edits undone), unless another owner holds the
/// Service's name.
pub async fn sync(
    client: &Client,
    lease: &str,
    namespace: &str,
    owner: &OwnerReference,
    port: u16,
    bound: &[Member],
    caches: Option<&super::view::LeaseCaches>,
) -> Result<ServiceState, kube::Error> {
    let services = Api::<Service>::namespaced(client.clone(), namespace);
    // Ours as the watch last saw it, else read: the name may be held by an object without
    // our label, which the watch does not see.
    let existing = match super::view::cached(caches.map(|c| &c.services), namespace, lease) {
        Some(s) => Some((*s).clone()),
        None => services.get_opt(lease).await?,
    };
    if let Some(existing) = &existing {
        let ours = existing
            .metadata
            .owner_references
            .as_ref()
            .is_some_and(|o| o.iter().any(|o| o.uid == owner.uid));
        if !ours {
            return Ok(ServiceState::Conflict(format!(
                "Service {lease} exists and does not belong to this lease (a pool of that \
                 name?); rename the lease or set spec.service to false"
            )));
        }
    }
    // Written only when what is there differs in our fields (discovery's comparison): a
    // settled lease's reconcile reads and writes nothing, while a deleted or hand-edited
    // object is put back.
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let want = service(lease, namespace, owner, port);
    if !discovery::service_current(existing.as_ref(), &want) {
        services.patch(lease, &params, &Patch::Apply(&want)).await?;
    }
    let slice_api = Api::<EndpointSlice>::namespaced(client.clone(), namespace);
    for s in slices(lease, namespace, owner, port, bound) {
        let name = s.metadata.name.clone().unwrap_or_default();
        let seen = match super::view::cached(caches.map(|c| &c.slices), namespace, &name) {
            Some(s) => Some((*s).clone()),
            None => slice_api.get_opt(&name).await?,
        };
        if !discovery::slice_current(seen.as_ref(), &s) {
            slice_api.patch(&name, &params, &Patch::Apply(&s)).await?;
        }
    }
    Ok(ServiceState::Ready)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, ip: &str, serving: bool) -> Member {
        Member {
            name: name.into(),
            uid: format!("uid-{name}"),
            address: Some(ip.parse().unwrap()),
            host: None,
            created: jiff::Timestamp::UNIX_EPOCH,
            template_hash: None,
            draining_since: None,
            leased: true,
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
            kind: "ProxyLease".into(),
            name: "crawler".into(),
            uid: "lease-uid".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    #[test]
    fn the_slices_list_the_serving_bound_proxies_under_the_lease_labels() {
        let mut draining = member("c", "192.0.2.3", true);
        draining.draining_since = Some(jiff::Timestamp::UNIX_EPOCH);
        let bound = [
            member("a", "192.0.2.1", true),
            member("b", "192.0.2.2", false),
            draining,
        ];
        let s = slices("crawler", "ns", &owner(), 3128, &bound);
        assert_eq!(s[0].metadata.name.as_deref(), Some("crawler-ipv4"));
        let addrs: Vec<&str> = s[0]
            .endpoints
            .iter()
            .flat_map(|e| e.addresses.iter().map(String::as_str))
            .collect();
        assert_eq!(addrs, ["192.0.2.1"]);
        let labels = s[0].metadata.labels.as_ref().unwrap();
        assert_eq!(labels[SERVICE_NAME_LABEL], "crawler");
        assert_eq!(labels[LEASE_SERVICE_LABEL], "crawler");
        assert!(!labels.contains_key(crate::api::proxy_pool::POOL_LABEL));
        let svc = service("crawler", "ns", &owner(), 3128);
        assert!(svc.spec.as_ref().unwrap().selector.is_none());
        let labels = svc.metadata.labels.unwrap();
        assert!(!labels.contains_key(crate::api::proxy_pool::POOL_LABEL));
        assert_eq!(svc.metadata.owner_references.unwrap()[0].uid, "lease-uid");
    }
}
