//! Fencing: a deposed replica stops acting before the new leader starts.

use std::sync::Mutex;

use crate::api::proxy::ProxySpec;
use crate::provider::decorate::Fenced;
use crate::provider::fake::FakeProvider;
use crate::provider::{
    BoxFuture, CreateRequest, Fence, Instance, InstanceId, Provider, ProviderError, ProxyRef,
    TargetListing,
};

use super::*;

/// One provider call as a replica made it: when it began and when it ended (returned,
/// or was dropped when cancelled).
#[derive(Debug, Clone)]
struct Call {
    replica: &'static str,
    op: &'static str,
    began: std::time::Instant,
    ended: Option<std::time::Instant>,
}

/// Both replicas' calls to the shared hosts, in order.
#[derive(Default)]
struct Calls(Mutex<Vec<Call>>);

impl Calls {
    fn all(&self) -> Vec<Call> {
        self.0.lock().unwrap().clone()
    }
}

/// Marks the call ended when dropped: on return and on cancellation alike.
struct Ends<'a> {
    calls: &'a Calls,
    index: usize,
}

impl Drop for Ends<'_> {
    fn drop(&mut self) {
        self.calls.0.lock().unwrap()[self.index].ended = Some(std::time::Instant::now());
    }
}

/// One replica's view of the shared hosts, each call logged with its replica.
struct Replica {
    name: &'static str,
    hosts: Arc<FakeProvider>,
    calls: Arc<Calls>,
}

impl Replica {
    fn begin(&self, op: &'static str) -> Ends<'_> {
        let mut calls = self.calls.0.lock().unwrap();
        calls.push(Call {
            replica: self.name,
            op,
            began: std::time::Instant::now(),
            ended: None,
        });
        Ends {
            calls: &self.calls,
            index: calls.len() - 1,
        }
    }
}

impl Provider for Replica {
    fn name(&self) -> &str {
        self.hosts.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            let _end = self.begin("create");
            self.hosts.create(req).await
        })
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            let _end = self.begin("get");
            self.hosts.get(id).await
        })
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            let _end = self.begin("delete");
            self.hosts.delete(id).await
        })
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(async move {
            let _end = self.begin("list");
            self.hosts.list().await
        })
    }
}

fn create_request() -> CreateRequest {
    CreateRequest {
        proxy: ProxyRef {
            namespace: "default".into(),
            name: "office".into(),
            uid: "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697801".into(),
        },
        spec: ProxySpec {
            provider: "kvm2".into(),
            ..Default::default()
        },
        user_data: None,
        fence: Fence::unfenced(),
    }
}

/// Two replicas drive the same hosts through the fence. Replica A's elector dies (a
/// stuck or partitioned process: the lease is not released) while A has a Create in
/// flight on a slow step. A's Create is cancelled within the grace, A starts nothing
/// more, and B, leading once A's lease expired, makes the only instance; no call of A
/// overlaps any call of B. Without the fence A's Create would run on for 30 s, well
/// into B's term, and define the same domain B does.
#[tokio::test]
async fn a_deposed_replica_stops_acting_before_the_new_leader_starts() {
    let fake = Arc::new(FakeApi::default());
    let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 3, 1))
        .await
        .unwrap();
    within(10, "replica-a to lead", a.acquired()).await.unwrap();
    let (mut b, b_elector) = LeaderElector::start(client(&fake), options("replica-b", 3, 1))
        .await
        .unwrap();
    let sampler = sample(a.clone(), b.clone());

    let hosts = Arc::new(FakeProvider::named("kvm2", &["h1"]));
    let calls = Arc::new(Calls::default());
    let grace = Duration::from_millis(300);
    let via = |name, leadership: &Leadership| {
        Arc::new(Fenced::new(
            Arc::new(Replica {
                name,
                hosts: hosts.clone(),
                calls: calls.clone(),
            }),
            leadership.fence(),
            grace,
        ))
    };
    let (via_a, via_b) = (via("a", &a), via("b", &b));

    // A's Create waits on a slow step (an image download).
    hosts.set_create_delay(Duration::from_secs(30));
    let in_flight = tokio::spawn({
        let via_a = via_a.clone();
        async move { via_a.create(&create_request()).await }
    });
    within(10, "A's Create to reach the hosts", async {
        while hosts.calls().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;

    a_elector.abort();
    let err = within(5, "A's Create to be cancelled", in_flight)
        .await
        .unwrap()
        .expect_err("A's Create must not finish");
    assert!(err.is_lease_lost(), "{err}");
    assert_eq!(err.class(), ErrorClass::Transient);
    assert!(hosts.instances().is_empty(), "A defined nothing");

    // A starts nothing more: every call is refused before it reaches the hosts.
    let reached = hosts.calls().len();
    let id = InstanceId {
        host: "h1".into(),
        name: "egress-x".into(),
    };
    assert!(
        via_a
            .create(&create_request())
            .await
            .unwrap_err()
            .is_lease_lost()
    );
    assert!(via_a.get(&id).await.unwrap_err().is_lease_lost());
    assert!(via_a.delete(&id).await.unwrap_err().is_lease_lost());
    let listing = via_a.list().await;
    assert!(
        listing.len() == 1 && listing[0].result.as_ref().is_err_and(|e| e.is_lease_lost()),
        "{listing:?}"
    );
    assert_eq!(
        hosts.calls().len(),
        reached,
        "A reached the hosts after losing"
    );

    // B leads once A's lease expired, and makes the one instance.
    within(15, "replica-b to take over", b.acquired())
        .await
        .unwrap();
    hosts.set_create_delay(Duration::ZERO);
    let made = via_b.create(&create_request()).await.unwrap();
    assert_eq!(hosts.instances(), vec![made]);

    let all = calls.all();
    let a_ended = all
        .iter()
        .filter(|c| c.replica == "a")
        .map(|c| c.ended.expect("an A call never ended"))
        .max()
        .unwrap();
    let b_began = all
        .iter()
        .filter(|c| c.replica == "b")
        .map(|c| c.began)
        .min()
        .unwrap();
    assert!(a_ended < b_began, "A and B acted at once: {all:?}");
    assert_eq!(
        all.iter().map(|c| (c.replica, c.op)).collect::<Vec<_>>(),
        vec![("a", "create"), ("b", "create")]
    );

    tokio::time::sleep(Duration::from_millis(200)).await;
    sampler.finish().await;
    b_elector.shutdown().await.unwrap();
    assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
}
