//! Types of the objects users and the operator write: the `Proxy`, `ProxyPool`, `ProxyLease` and
//! `ProviderHealth` custom resources, and the CRD documents generated from them.

pub mod provider_health;
pub mod proxy;
pub mod proxy_lease;
pub mod proxy_pool;

use kube::CustomResourceExt;

/// Every CRD as one multi-document YAML stream, in a stable order: what `egress-operator
/// crd` prints and what `config/crd/` must hold.
pub fn crds_yaml() -> Result<String, serde_yaml_ng::Error> {
    let mut out = String::new();
    for crd in [
        proxy::Proxy::crd(),
        provider_health::ProviderHealth::crd(),
        proxy_pool::ProxyPool::crd(),
        proxy_lease::ProxyLease::crd(),
    ] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd)?);
    }
    Ok(out)
}
