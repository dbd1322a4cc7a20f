//! Which Proxies exist: the [`ProxyIndex`] the sweeps read owners from, over the
//! Kubernetes API ([`KubeProxyIndex`]) or in memory for tests ([`FakeProxyIndex`]).

use std::collections::HashMap;
use std::sync::Mutex;

use super::GcError;
use crate::api::proxy::Proxy;
use crate::error::ErrorClass;
use crate::provider::{BoxFuture, InstanceId};

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
pub(super) fn owner_of(p: &Proxy) -> Option<(String, Owner)> {
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
