//! What the fleet controllers read at rest: the objects their own watches already hold.
//!
//! A change of a fast-probe verdict wakes every pool and every live lease, and each
//! resync wakes them again. Reading the API server on each of those wake-ups made a quiet
//! fleet of 1000 leases cost hundreds of reads a minute (issue 35, item 4). The watches
//! that wake a controller are reflected into stores instead, and a reconcile reads those.
//!
//! Two rules keep that safe:
//! - **Never block on a store.** A store is filled by the controller polling its trigger
//!   streams, and the controller stops polling them while all its workers are busy: a
//!   reconcile that waited for the first listing could wait forever. A reconcile that
//!   finds a store not yet filled looks again shortly ([`NOT_FILLED_RETRY`]) instead.
//! - **A write is decided on fresh reads.** A store can lag the API server by a watch
//!   event. A controller plans from its stores only to learn whether there is anything to
//!   do; when there is, it reads the API server again and plans on that before it writes
//!   (the pool and the lease controllers), or writes only objects it fully owns and
//!   compares first (discovery's Services and slices, which the next watch event corrects).

use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, Stream};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};

use crate::api::proxy::Proxy;
use crate::api::proxy_pool::POOL_LABEL;

/// How soon a reconcile that found a store not yet filled looks again.
pub const NOT_FILLED_RETRY: Duration = Duration::from_secs(1);

/// A reflected watch: the store a reconcile reads.
#[derive(Clone)]
pub struct Cache<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    store: Store<K>,
}

impl<K> std::fmt::Debug for Cache<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("filled", &self.filled())
            .field("objects", &self.store.len())
            .finish()
    }
}

impl<K> Cache<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    /// Wraps a store some stream fills.
    pub fn new(store: Store<K>) -> Self {
        Self { store }
    }

    /// Whether the first listing has arrived: before that, an empty store says nothing.
    /// Never waits (see the module's first rule).
    pub fn filled(&self) -> bool {
        matches!(self.store.wait_until_ready().now_or_never(), Some(Ok(())))
    }

    /// The objects of `ns` for which `keep` holds, or `None` while not [`filled`](Self::filled).
    pub fn select(&self, ns: &str, keep: impl Fn(&K) -> bool) -> Option<Vec<Arc<K>>> {
        if !self.filled() {
            return None;
        }
        Some(
            self.store
                .state()
                .into_iter()
                .filter(|o| o.meta().namespace.as_deref() == Some(ns) && keep(o))
                .collect(),
        )
    }

    /// The object `name` in `ns` (`Some(None)`: filled, and not there).
    pub fn get(&self, ns: Option<&str>, name: &str) -> Option<Option<Arc<K>>>
    where
        K::DynamicType: Default,
    {
        if !self.filled() {
            return None;
        }
        let mut r = reflector::ObjectRef::<K>::new(name);
        if let Some(ns) = ns {
            r = r.within(ns);
        }
        Some(self.store.get(&r))
    }
}

impl Cache<Proxy> {
    /// The Proxies of `ns` labelled for `pool` (the label only: membership is decided by
    /// the caller, from owner UIDs).
    pub fn labelled_for(&self, ns: &str, pool: &str) -> Option<Vec<Arc<Proxy>>> {
        self.select(ns, |p| {
            p.labels().get(POOL_LABEL).map(String::as_str) == Some(pool)
        })
    }
}

/// Reflects `api`'s watch with `config` into a [`Cache`]; the stream (which the controller
/// polls as a trigger) yields every object that changed or went.
pub fn reflected<K>(
    api: Api<K>,
    config: watcher::Config,
) -> (
    Cache<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Default + Send + Sync,
{
    let (store, writer) = reflector::store();
    let events = watcher(api, config)
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    (Cache::new(store), events)
}

/// The pool-labelled Proxies of every namespace, as every fleet controller watches them.
pub fn pool_proxies(
    client: kube::Client,
) -> (
    Cache<Proxy>,
    impl Stream<Item = Result<Proxy, watcher::Error>> + Send + 'static,
) {
    reflected(
        Api::<Proxy>::all(client),
        watcher::Config::default().labels(POOL_LABEL).any_semantic(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher::Event;

    fn proxy(ns: &str, name: &str, pool: &str) -> Proxy {
        let mut p = Proxy::new(name, Default::default());
        p.metadata.namespace = Some(ns.into());
        p.metadata.labels = Some([(POOL_LABEL.to_string(), pool.to_string())].into());
        p
    }

    #[test]
    fn an_unfilled_store_answers_none_and_never_blocks() {
        let (store, mut writer) = reflector::store::<Proxy>();
        let cache = Cache::new(store);
        assert!(!cache.filled());
        assert!(cache.labelled_for("a", "office").is_none());
        assert!(cache.get(Some("a"), "x").is_none());
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitApply(proxy("a", "x", "office")));
        writer.apply_watcher_event(&Event::InitApply(proxy("a", "y", "other")));
        writer.apply_watcher_event(&Event::InitApply(proxy("b", "z", "office")));
        // Still listing: not filled.
        assert!(cache.labelled_for("a", "office").is_none());
        writer.apply_watcher_event(&Event::InitDone);
        let names: Vec<String> = cache
            .labelled_for("a", "office")
            .unwrap()
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, ["x"]);
        assert!(cache.get(Some("a"), "x").unwrap().is_some());
        assert!(cache.get(Some("a"), "gone").unwrap().is_none());
    }
}
