//! The collector's tests, by collector, over the fake provider and index: the helpers
//! here, the cases in [`domains`], [`volumes`] and [`index`].

use super::*;
use crate::api::proxy::Proxy;
use crate::provider::fake::FakeProvider;
use crate::provider::{BoxFuture, Instance};
use crate::provider::{
    CreateRequest, InstanceState, Provider, ProviderError, ProxyRef, TargetListing,
};
use prometheus_client::registry::Registry;
use tokio::sync::Notify;

const GRACE: u32 = 600;

fn now() -> Timestamp {
    "2026-03-01T12:00:00Z".parse().unwrap()
}

fn ago(secs: i64) -> String {
    (now() - SignedDuration::from_secs(secs)).to_string()
}

fn id(host: &str, name: &str) -> InstanceId {
    InstanceId {
        host: host.into(),
        name: name.into(),
    }
}

fn instance(host: &str, uid: &str, created_at: &str) -> Instance {
    Instance {
        id: id(host, &format!("egress-{uid}")),
        proxy: ProxyRef {
            namespace: "ns".into(),
            name: format!("p-{uid}"),
            uid: uid.into(),
        },
        state: InstanceState::Running,
        addresses: vec![],
        address_source: None,
        seed_applied: None,
        created_at: created_at.into(),
    }
}

fn owner(instance_id: Option<InstanceId>) -> Owner {
    Owner {
        namespace: "ns".into(),
        name: "p".into(),
        instance_id,
        deleting: false,
        provisioning: false,
    }
}

fn collector(
    providers: Vec<SharedProvider>,
    index: Arc<FakeProxyIndex>,
    metrics: GcMetrics,
) -> GarbageCollector {
    let config = GcConfig {
        period_seconds: 3600,
        grace_period_seconds: GRACE,
        ..GcConfig::default()
    };
    GarbageCollector::new(providers, index, &config, metrics).with_clock(now)
}

fn setup(targets: &[&str]) -> (Arc<FakeProvider>, Arc<FakeProxyIndex>, GarbageCollector) {
    let fake = Arc::new(FakeProvider::new(targets));
    let index = Arc::new(FakeProxyIndex::new());
    let gc = collector(vec![fake.clone()], index.clone(), GcMetrics::default());
    (fake, index, gc)
}

fn ids(fake: &FakeProvider) -> Vec<InstanceId> {
    fake.instances().into_iter().map(|i| i.id).collect()
}

fn deletes(fake: &FakeProvider) -> usize {
    fake.calls().iter().filter(|c| **c == "delete").count()
}

mod domains;
mod index;
mod volumes;
