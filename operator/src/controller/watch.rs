//! The operator's watches of its own kinds, decoded one object at a time, and their
//! health.
//!
//! kube-runtime's watcher decodes a LIST page or a watch event as a whole: one object our
//! types cannot read (a CRD newer than this binary during a rolling update or a rollback)
//! fails the page, the watcher retries it forever, nothing reconciles and no finalizer
//! comes off. So the controllers watch Proxies, ProxyPools and ProxyLeases as untyped
//! objects and decode each one here ([`proxies`], [`decoded`]; issue 33, item 10 for the
//! fleet's kinds). For Proxies:
//!
//! - a spec with fields this binary does not know still decodes (the spec types accept
//!   unknown fields); the fields are remembered by UID ([`Skew`]) and the reconcile refuses
//!   to create for that Proxy with a permanent error naming them, instead of building a VM
//!   that ignores what was asked. Its deletion works as usual;
//! - an object that does not decode at all is logged at error, counted, reported on
//!   `/readyz` and left out; every other Proxy goes on.
//!
//! For pools and leases (whose specs refuse unknown fields: a pool cannot make Proxies
//! from a template it only half reads) an object that does not decode is reported and
//! left out the same way.
//!
//! Watch failures (the API server unreachable, RBAC, an expired resource version) are
//! logged at warn, counted, and make `/readyz` say `watch: degraded` until the watch
//! delivers again.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures_util::{Stream, StreamExt};
use kube::api::{ApiResource, DynamicObject, ObjectMeta};
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;

use crate::api::proxy::{Proxy, unknown_fields};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    /// `watch` or `decode`.
    kind: String,
    /// The watched kind, lower case: `proxy`, `proxypool`, `proxylease`.
    resource: String,
}

/// What the watch went through, for `/readyz` and the `egress_controller_watch_errors`
/// counter. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct WatchHealth {
    inner: Arc<Mutex<HealthState>>,
    errors: Family<Kind, Counter>,
}

#[derive(Debug, Default)]
struct HealthState {
    /// The last error of each failing watch, by resource, while it has not delivered since.
    failing: BTreeMap<&'static str, String>,
    /// (resource, `namespace/name`) of objects that do not decode, with why.
    undecodable: BTreeMap<(&'static str, String), String>,
}

impl WatchHealth {
    /// Registered as `egress_controller_watch_errors{kind="watch"|"decode",resource}`.
    pub fn register(registry: &mut Registry) -> Self {
        let h = Self::default();
        registry.register(
            "egress_controller_watch_errors",
            "watch failures (kind=watch) and objects this operator cannot decode (kind=decode, \
             e.g. a CRD newer than the binary), by resource (proxy, proxypool, proxylease)",
            h.errors.clone(),
        );
        h
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Errors counted of this kind (`watch` or `decode`), over every resource.
    pub fn errors(&self, kind: &str) -> u64 {
        ["proxy", "proxypool", "proxylease"]
            .into_iter()
            .map(|r| self.errors_of(kind, r))
            .sum()
    }

    /// Errors counted of this kind (`watch` or `decode`) for one resource.
    pub fn errors_of(&self, kind: &str, resource: &str) -> u64 {
        self.errors
            .get(&Kind {
                kind: kind.into(),
                resource: resource.into(),
            })
            .map_or(0, |c| c.get())
    }

    fn count(&self, kind: &str, resource: &str) {
        self.errors
            .get_or_create(&Kind {
                kind: kind.into(),
                resource: resource.into(),
            })
            .inc();
    }

    /// The Proxy watch failed; it is retried with backoff.
    pub fn watch_failed(&self, error: &watcher::Error) {
        self.failed("proxy", error);
    }

    /// The watch of `resource` failed; it is retried with backoff.
    pub fn failed(&self, resource: &'static str, error: &watcher::Error) {
        self.count("watch", resource);
        tracing::warn!(%resource, error = %error, "a watch failed; retrying (readyz: degraded)");
        self.lock().failing.insert(resource, error.to_string());
    }

    /// The Proxy watch delivered.
    pub fn watch_ok(&self) {
        self.ok("proxy");
    }

    /// The watch of `resource` delivered.
    pub fn ok(&self, resource: &'static str) {
        let mut s = self.lock();
        if s.failing.remove(resource).is_some() {
            tracing::info!(%resource, "the watch works again");
        }
    }

    fn undecodable(&self, resource: &'static str, key: String, error: String) {
        self.count("decode", resource);
        tracing::error!(
            %resource,
            object = %key,
            error = %error,
            "cannot decode the object (is the installed CRD newer than this operator?); \
             it is not reconciled, the others are"
        );
        self.lock().undecodable.insert((resource, key), error);
    }

    fn decoded(&self, resource: &'static str, key: &str) {
        self.lock().undecodable.remove(&(resource, key.to_string()));
    }

    /// None when all is well; else the lines `/readyz` shows after `watch: degraded`.
    pub fn degraded(&self) -> Option<Vec<String>> {
        let s = self.lock();
        if s.failing.is_empty() && s.undecodable.is_empty() {
            return None;
        }
        let mut lines = Vec::new();
        for (resource, e) in &s.failing {
            lines.push(match *resource {
                "proxy" => format!("watch failing: {e}"),
                other => format!("{other} watch failing: {e}"),
            });
        }
        for ((resource, key), e) in &s.undecodable {
            lines.push(format!("{resource} {key} cannot be decoded: {e}"));
        }
        Some(lines)
    }
}

/// Spec fields this binary does not know, by Proxy UID, as `spec.a.b` paths.
#[derive(Clone, Debug, Default)]
pub struct Skew(Arc<Mutex<HashMap<String, Vec<String>>>>);

impl Skew {
    /// Records the unknown spec fields of a Proxy (none: forgets it).
    pub fn set(&self, uid: &str, fields: Vec<String>) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if fields.is_empty() {
            m.remove(uid);
        } else {
            m.insert(uid.to_string(), fields);
        }
    }

    /// The unknown spec fields of this Proxy (empty when none).
    pub fn unknown(&self, uid: &str) -> Vec<String> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.get(uid).cloned().unwrap_or_default()
    }
}

/// One untyped Proxy decoded: the Proxy and its unknown spec fields, or why it failed.
pub fn decode(obj: DynamicObject) -> Result<(Proxy, Vec<String>), String> {
    let raw = serde_json::to_value(&obj).map_err(|e| e.to_string())?;
    let proxy: Proxy = serde_json::from_value(raw.clone()).map_err(|e| e.to_string())?;
    let known = serde_json::to_value(&proxy.spec).map_err(|e| e.to_string())?;
    let unknown = unknown_fields("spec", &raw["spec"], &known);
    Ok((proxy, unknown))
}

fn key_of(obj: &DynamicObject) -> String {
    format!(
        "{}/{}",
        obj.metadata.namespace.as_deref().unwrap_or_default(),
        obj.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Decodes every object of one watch event; drops (and reports) those that fail. A
/// deleted object that does not decode still leaves the cache, as a Proxy with only its
/// metadata.
fn decode_event(
    ev: watcher::Event<DynamicObject>,
    health: &WatchHealth,
    skew: &Skew,
) -> Option<watcher::Event<Proxy>> {
    let one = |obj: DynamicObject| -> Option<Proxy> {
        let key = key_of(&obj);
        let uid = obj.metadata.uid.clone().unwrap_or_default();
        match decode(obj) {
            Ok((proxy, unknown)) => {
                health.decoded("proxy", &key);
                if !unknown.is_empty() {
                    tracing::error!(
                        proxy = %key,
                        fields = %unknown.join(", "),
                        "the Proxy sets spec fields this operator does not know; it is refused"
                    );
                }
                skew.set(&uid, unknown);
                Some(proxy)
            }
            Err(e) => {
                health.undecodable("proxy", key, e);
                None
            }
        }
    };
    use watcher::Event as E;
    match ev {
        E::Init => Some(E::Init),
        E::InitDone => Some(E::InitDone),
        E::Apply(o) => one(o).map(E::Apply),
        E::InitApply(o) => one(o).map(E::InitApply),
        E::Delete(o) => {
            let key = key_of(&o);
            health.decoded("proxy", &key);
            skew.set(o.metadata.uid.as_deref().unwrap_or_default(), Vec::new());
            let mut p = Proxy::new("", Default::default());
            p.metadata = o.metadata;
            Some(E::Delete(p))
        }
    }
}

/// Decodes every object of one watch event of `resource`; drops (and reports) those that
/// fail. A deleted object leaves the cache whether it decodes or not (`stub` makes an
/// object of its metadata, all the cache needs to drop it).
fn decode_generic<K>(
    ev: watcher::Event<DynamicObject>,
    resource: &'static str,
    health: &WatchHealth,
    stub: fn(ObjectMeta) -> K,
) -> Option<watcher::Event<K>>
where
    K: DeserializeOwned,
{
    let one = |obj: DynamicObject| -> Option<K> {
        let key = key_of(&obj);
        let decoded = serde_json::to_value(&obj)
            .and_then(serde_json::from_value::<K>)
            .map_err(|e| e.to_string());
        match decoded {
            Ok(k) => {
                health.decoded(resource, &key);
                Some(k)
            }
            Err(e) => {
                health.undecodable(resource, key, e);
                None
            }
        }
    };
    use watcher::Event as E;
    match ev {
        E::Init => Some(E::Init),
        E::InitDone => Some(E::InitDone),
        E::Apply(o) => one(o).map(E::Apply),
        E::InitApply(o) => one(o).map(E::InitApply),
        E::Delete(o) => {
            health.decoded(resource, &key_of(&o));
            // Decoded when it can be, so what a deletion wakes (a lease's pool) is known;
            // else its metadata, all the cache needs to drop it.
            let decoded = serde_json::to_value(&o)
                .and_then(serde_json::from_value::<K>)
                .ok();
            Some(E::Delete(decoded.unwrap_or_else(|| stub(o.metadata))))
        }
    }
}

/// A watch of `K` (`resource` names it in logs, metrics and `/readyz`), decoded one
/// object at a time, with backoff and health: what a typed `watcher` gives, except that
/// one object this binary cannot read is reported and left out instead of failing every
/// page and stopping the controller.
pub fn decoded<K>(
    client: Client,
    config: watcher::Config,
    health: WatchHealth,
    resource: &'static str,
    stub: fn(ObjectMeta) -> K,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Send + 'static,
{
    let ar = ApiResource::erase::<K>(&());
    let api = Api::<DynamicObject>::all_with(client, &ar);
    let inspect = health.clone();
    let events = watcher::watcher(api, config).inspect(move |r| match r {
        Ok(_) => inspect.ok(resource),
        Err(e) => inspect.failed(resource, e),
    });
    kube::runtime::WatchStreamExt::default_backoff(events).filter_map(move |r| {
        let out = match r {
            Ok(ev) => decode_generic(ev, resource, &health, stub).map(Ok),
            Err(e) => Some(Err(e)),
        };
        std::future::ready(out)
    })
}

/// What [`list_decoded`] read.
#[derive(Debug, Clone)]
pub struct Listed<K> {
    /// The objects that decoded.
    pub items: Vec<K>,
    /// Those that did not, untyped: they exist, and what depends on their existence (a
    /// lease holding proxies) must not take them for gone.
    pub undecodable: Vec<DynamicObject>,
}

/// Lists every `K` (in `namespace`, or all) with `params`, decoding each object on its
/// own: one this binary cannot read is set apart instead of failing the whole list. The
/// watch of the same kind reports it (log, count, `/readyz`); a list is read too often to
/// report each time.
pub async fn list_decoded<K>(
    client: Client,
    namespace: Option<&str>,
    params: &kube::api::ListParams,
) -> Result<Listed<K>, kube::Error>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    let ar = ApiResource::erase::<K>(&());
    let api = match namespace {
        Some(ns) => Api::<DynamicObject>::namespaced_with(client, ns, &ar),
        None => Api::<DynamicObject>::all_with(client, &ar),
    };
    let mut out = Listed {
        items: Vec::new(),
        undecodable: Vec::new(),
    };
    for obj in api.list(params).await?.items {
        match serde_json::to_value(&obj).and_then(serde_json::from_value::<K>) {
            Ok(k) => out.items.push(k),
            Err(e) => {
                tracing::debug!(object = %key_of(&obj), error = %e, "listed an object this binary cannot decode");
                out.undecodable.push(obj);
            }
        }
    }
    Ok(out)
}

/// The Proxy watch over every namespace, decoded per object, with backoff and health.
pub fn proxies(
    client: Client,
    config: watcher::Config,
    health: WatchHealth,
    skew: Skew,
) -> impl Stream<Item = Result<watcher::Event<Proxy>, watcher::Error>> + Send + 'static {
    let ar = ApiResource::erase::<Proxy>(&());
    let api = Api::<DynamicObject>::all_with(client, &ar);
    let inspect = health.clone();
    let events = watcher::watcher(api, config).inspect(move |r| match r {
        Ok(_) => inspect.watch_ok(),
        Err(e) => inspect.watch_failed(e),
    });
    kube::runtime::WatchStreamExt::default_backoff(events).filter_map(move |r| {
        let out = match r {
            Ok(ev) => decode_event(ev, &health, &skew).map(Ok),
            Err(e) => Some(Err(e)),
        };
        std::future::ready(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn dynamic(spec: Value) -> DynamicObject {
        named("p", spec)
    }

    fn named(name: &str, spec: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}")},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn unknown_spec_fields_decode_and_are_named() {
        let (p, unknown) = decode(dynamic(json!({
            "provider": "kvm2",
            "dnsServers": ["192.0.2.1"],
            "userData": {"secretRef": {"name": "s", "key": "k", "optional": true}},
            "templateSettings": {"domain": {"anyKey": 1}},
            "image": null,
        })))
        .unwrap();
        assert_eq!(p.spec.provider, "kvm2");
        assert_eq!(
            unknown,
            vec![
                "spec.dnsServers".to_string(),
                "spec.userData.secretRef.optional".to_string()
            ],
            "free-form templateSettings round-trip; nulls are unset"
        );
    }

    #[test]
    fn a_proxy_of_the_wrong_shape_is_reported_and_left_out_the_others_pass() {
        let health = WatchHealth::default();
        let skew = Skew::default();
        let bad = dynamic(json!({"provider": {"name": "kvm2"}}));
        assert!(decode_event(watcher::Event::InitApply(bad), &health, &skew).is_none());
        let good = named("q", json!({"provider": "kvm2"}));
        assert!(matches!(
            decode_event(watcher::Event::InitApply(good), &health, &skew),
            Some(watcher::Event::InitApply(_))
        ));
        assert_eq!(health.errors("decode"), 1);
        let lines = health.degraded().expect("degraded");
        assert!(
            lines[0].starts_with("proxy ns/p cannot be decoded"),
            "{lines:?}"
        );
        // Deleted: no longer reported, and its cache entry goes.
        let bad = dynamic(json!({"provider": 7}));
        assert!(matches!(
            decode_event(watcher::Event::Delete(bad), &health, &skew),
            Some(watcher::Event::Delete(_))
        ));
        assert_eq!(health.degraded(), None);
    }

    #[test]
    fn watch_failures_degrade_until_the_watch_delivers() {
        let health = WatchHealth::default();
        assert_eq!(health.degraded(), None);
        health.watch_failed(&watcher::Error::NoResourceVersion);
        assert_eq!(health.errors("watch"), 1);
        assert!(health.degraded().unwrap()[0].starts_with("watch failing: "));
        health.watch_ok();
        assert_eq!(health.degraded(), None);
    }
}
