//! The Proxy watch, decoded one object at a time, and its health.
//!
//! kube-runtime's watcher decodes a LIST page or a watch event as a whole: one Proxy our
//! types cannot read (a CRD newer than this binary during a rolling update or a rollback)
//! fails the page, the watcher retries it forever, nothing reconciles and no finalizer
//! comes off. So the controller watches Proxies as untyped objects and decodes each one
//! here:
//!
//! - a spec with fields this binary does not know still decodes (the spec types accept
//!   unknown fields); the fields are remembered by UID ([`Skew`]) and the reconcile refuses
//!   to create for that Proxy with a permanent error naming them, instead of building a VM
//!   that ignores what was asked. Its deletion works as usual;
//! - an object that does not decode at all is logged at error, counted, reported on
//!   `/readyz` and left out; every other Proxy goes on.
//!
//! Watch failures (the API server unreachable, RBAC, an expired resource version) are
//! logged at warn, counted, and make `/readyz` say `watch: degraded` until the watch
//! delivers again.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures_util::{Stream, StreamExt};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher;
use kube::{Api, Client};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::api::proxy::{Proxy, unknown_fields};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: String,
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
    /// The last watch error, while the watch has not delivered since.
    failing: Option<String>,
    /// `namespace/name` of Proxies that do not decode, with why.
    undecodable: BTreeMap<String, String>,
}

impl WatchHealth {
    /// Registered as `egress_controller_watch_errors{kind="watch"|"decode"}`.
    pub fn register(registry: &mut Registry) -> Self {
        let h = Self::default();
        registry.register(
            "egress_controller_watch_errors",
            "Proxy watch failures (kind=watch) and Proxies this operator cannot decode \
             (kind=decode, e.g. a CRD newer than the binary)",
            h.errors.clone(),
        );
        h
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Errors counted of this kind (`watch` or `decode`).
    pub fn errors(&self, kind: &str) -> u64 {
        self.errors.get_or_create(&Kind { kind: kind.into() }).get()
    }

    fn count(&self, kind: &str) {
        self.errors.get_or_create(&Kind { kind: kind.into() }).inc();
    }

    /// The watch failed; it is retried with backoff.
    pub fn watch_failed(&self, error: &watcher::Error) {
        self.count("watch");
        tracing::warn!(error = %error, "the Proxy watch failed; retrying (readyz: degraded)");
        self.lock().failing = Some(error.to_string());
    }

    /// The watch delivered.
    pub fn watch_ok(&self) {
        let mut s = self.lock();
        if s.failing.take().is_some() {
            tracing::info!("the Proxy watch works again");
        }
    }

    fn undecodable(&self, key: String, error: String) {
        self.count("decode");
        tracing::error!(
            proxy = %key,
            error = %error,
            "cannot decode the Proxy (is the installed CRD newer than this operator?); \
             it is not reconciled, the others are"
        );
        self.lock().undecodable.insert(key, error);
    }

    fn decoded(&self, key: &str) {
        self.lock().undecodable.remove(key);
    }

    /// None when all is well; else the lines `/readyz` shows after `watch: degraded`.
    pub fn degraded(&self) -> Option<Vec<String>> {
        let s = self.lock();
        if s.failing.is_none() && s.undecodable.is_empty() {
            return None;
        }
        let mut lines = Vec::new();
        if let Some(e) = &s.failing {
            lines.push(format!("watch failing: {e}"));
        }
        for (key, e) in &s.undecodable {
            lines.push(format!("proxy {key} cannot be decoded: {e}"));
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
                health.decoded(&key);
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
                health.undecodable(key, e);
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
            health.decoded(&key);
            skew.set(o.metadata.uid.as_deref().unwrap_or_default(), Vec::new());
            let mut p = Proxy::new("", Default::default());
            p.metadata = o.metadata;
            Some(E::Delete(p))
        }
    }
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
