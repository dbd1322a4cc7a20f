//! Builds the configured providers by name, each wrapped in the tracing and metrics
//! decorators, so the controller looks a provider up by the Proxy's `spec.provider`.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::decorate::{Metered, ProviderMetrics, Traced};
use super::health::HealthBoard;
use super::kvm2::backend::{Kvm2Options, Kvm2Provider, PROVIDER_NAME};
use super::kvm2::hosts::{HostError, Hosts};
use super::kvm2::image::ImageMetrics;
use super::kvm2::libvirt::BlockingPool;
use super::kvm2::observe::CallMetrics;
use super::kvm2::ops::LibvirtOps;
use super::{Provider, SharedProvider};
use crate::config::ValidConfig;
use crate::templates::TemplateSet;

/// The providers of one config.
#[derive(Default)]
pub struct Registry {
    providers: BTreeMap<String, SharedProvider>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("providers", &self.providers.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Everything the kvm2 provider is built from, besides the config.
#[derive(Debug, Clone)]
pub struct Kvm2Parts {
    /// The hosts table (kept by the caller to close it on shutdown).
    pub hosts: Arc<Hosts>,
    /// Provider-level metrics.
    pub metrics: ProviderMetrics,
    /// The board kvm2 placement reads (the one from the options): the run mode gives it
    /// to the health monitor, which writes it.
    pub health: HealthBoard,
    /// The provider itself, undecorated: the garbage collector sweeps its leftover
    /// volumes through it.
    pub provider: Arc<Kvm2Provider>,
}

impl Registry {
    /// An empty registry (tests add fakes with [`Registry::insert`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds every provider the config defines (today: `kvm2`), decorated.
    pub fn from_config(
        config: Arc<ValidConfig>,
        templates: Arc<TemplateSet>,
        options: Kvm2Options,
        registry: Option<&mut prometheus_client::registry::Registry>,
    ) -> Result<(Self, Kvm2Parts), HostError> {
        let live = Arc::new(crate::config::live::Live::new(config, templates));
        Self::from_live(live, options, registry)
    }

    /// Builds every provider the config in `live` defines, rendering with the config a
    /// reload installs there (the hosts' connections are made now, from the config in
    /// force).
    pub fn from_live(
        live: Arc<crate::config::live::Live>,
        options: Kvm2Options,
        registry: Option<&mut prometheus_client::registry::Registry>,
    ) -> Result<(Self, Kvm2Parts), HostError> {
        let config = live.config();
        let mut options = options;
        let (call_metrics, image_metrics, metrics) = match registry {
            Some(r) => {
                options.sharing =
                    crate::provider::kvm2::domain::sharing::SharingMetrics::register(r);
                options.index = crate::provider::kvm2::domain::index::IndexMetrics::register(r);
                (
                    CallMetrics::register(r),
                    ImageMetrics::register(r),
                    ProviderMetrics::register(r),
                )
            }
            None => (
                CallMetrics::unregistered(),
                ImageMetrics::default(),
                ProviderMetrics::default(),
            ),
        };
        let hosts = Arc::new(Hosts::new(
            &config.kvm2.ssh,
            &config.kvm2.hosts,
            BlockingPool::default(),
            Arc::new(call_metrics),
        )?);
        let ops = Arc::new(LibvirtOps::new(hosts.clone()));
        let health = options.health.clone();
        let kvm2 = Arc::new(Kvm2Provider::with_live(live, ops, options, image_metrics));
        let mut me = Self::new();
        me.insert(decorate(kvm2.clone(), metrics.clone()));
        Ok((
            me,
            Kvm2Parts {
                hosts,
                metrics,
                health,
                provider: kvm2,
            },
        ))
    }

    /// Adds (or replaces) a provider under its own name.
    pub fn insert(&mut self, provider: SharedProvider) {
        self.providers.insert(provider.name().to_string(), provider);
    }

    /// The provider of that name.
    pub fn get(&self, name: &str) -> Option<&SharedProvider> {
        self.providers.get(name)
    }

    /// Provider names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.providers.keys().map(String::as_str)
    }
}

/// Wraps a provider in the tracing and metrics decorators.
pub fn decorate<P: Provider + 'static>(p: Arc<P>, metrics: ProviderMetrics) -> SharedProvider {
    Arc::new(Metered::new(Arc::new(Traced::new(p)), metrics))
}

/// The name every kvm2 Proxy uses in `spec.provider`.
pub const KVM2: &str = PROVIDER_NAME;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fake::FakeProvider;

    #[tokio::test]
    async fn providers_are_found_by_name_decorated_with_their_capabilities() {
        let metrics = ProviderMetrics::default();
        let mut registry = Registry::new();
        registry.insert(decorate(
            Arc::new(FakeProvider::new(&["a"])),
            metrics.clone(),
        ));
        assert_eq!(registry.names().collect::<Vec<_>>(), vec!["fake"]);
        assert!(registry.get(KVM2).is_none());
        let p = registry.get("fake").unwrap();
        assert!(p.health().is_some());
        assert_eq!(p.list().await.len(), 1);
        assert_eq!(metrics.calls("fake", "list", "ok"), 1);
    }
}
