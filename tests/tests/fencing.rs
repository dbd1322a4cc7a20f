//! Leader fencing inside a kvm2 Create, against the in-memory fake hosts ([`FakeOps`]): a
//! Create whose replica loses the leader lease part-way checks its fence right before it
//! defines the domain and right before it starts it, fails with a transient "lease lost",
//! and removes what it made, so it never defines or starts over the new leader's Create
//! of the same domain. The lease is lost from inside the Create by an [`OpHook`] on the
//! step before the check.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_operator::Classified as _;
use egress_operator::api::proxy::ProxySpec;
use egress_operator::error::ErrorClass;
use egress_operator::instance::InstanceIdentity;
use egress_operator::provider::kvm2::backend::Kvm2Provider;
use egress_operator::provider::kvm2::fake::{FakeOps, Hooked, OpHook};
use egress_operator::provider::kvm2::ops::{HostOps, OpsError};
use egress_operator::provider::{
    BoxFuture, CreateRequest, Fence, Provider, ProviderError, ProxyRef, UserData,
};
use integration_tests::fake_rig::{self, FakeConfig};
use integration_tests::http::{HttpServer, Route};
use integration_tests::sha256_hex;
use tokio::sync::watch;

/// A hang fails the test instead of blocking CI; not a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);
const UID: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a6978f1";

/// Loses the lease on operation `op` about `target` (any target when empty), before it
/// runs: the replica's lease went while the Create was between two steps.
struct LoseLeaseOn {
    op: &'static str,
    target: String,
    lease: watch::Sender<bool>,
    seen: Mutex<Vec<&'static str>>,
}

impl std::fmt::Debug for LoseLeaseOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoseLeaseOn").field("op", &self.op).finish()
    }
}

impl OpHook for LoseLeaseOn {
    fn before<'a>(
        &'a self,
        op: &'static str,
        _host: &'a str,
        target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        self.seen.lock().unwrap().push(op);
        if op == self.op && (self.target.is_empty() || target == Some(self.target.as_str())) {
            self.lease.send_replace(false);
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

struct World {
    _http: HttpServer,
    fake: Arc<FakeOps>,
    provider: Kvm2Provider,
    hooked: Arc<Hooked<LoseLeaseOn>>,
    fence: Fence,
}

impl World {
    fn new(op: &'static str, target: String) -> Self {
        let bytes = fake_rig::test_image(512 << 20, 5500);
        let http =
            HttpServer::start(vec![("/img".to_string(), Route::Body(bytes.clone()))]).unwrap();
        let config = FakeConfig::new(&http.url("/img"), &sha256_hex(&bytes))
            .name("fencing-config")
            .build();
        let fake = Arc::new(FakeOps::new(&["h1"], 1 << 40));
        let (lease, rx) = watch::channel(true);
        let hooked = Arc::new(Hooked::wrap(
            fake.clone() as Arc<dyn HostOps>,
            LoseLeaseOn {
                op,
                target,
                lease,
                seen: Mutex::new(Vec::new()),
            },
        ));
        // A stuck image wait fails within the hang guard.
        let mut options = fake_rig::fast_options();
        options.images.max_wait = Duration::from_secs(20);
        let provider =
            fake_rig::provider_with(&config, hooked.clone() as Arc<dyn HostOps>, options);
        Self {
            _http: http,
            fake,
            provider,
            hooked,
            fence: Fence::new(rx),
        }
    }

    fn request(&self) -> CreateRequest {
        CreateRequest {
            proxy: ProxyRef {
                namespace: "default".into(),
                name: "office".into(),
                uid: UID.into(),
            },
            spec: ProxySpec {
                provider: "kvm2".into(),
                ..Default::default()
            },
            user_data: Some(UserData::new(b"#cloud-config\n".to_vec())),
            fence: self.fence.clone(),
        }
    }

    async fn create_fails(&self) -> ProviderError {
        let req = self.request();
        match tokio::time::timeout(HANG_GUARD, self.provider.create(&req)).await {
            Ok(Ok(i)) => panic!("the Create succeeded: {:?}", i.id),
            Ok(Err(e)) => e,
            Err(_) => panic!("the Create hung"),
        }
    }

    /// Nothing of this Proxy's VM is left: no domain, no root or seed volume.
    fn assert_vm_gone(&self) {
        let id = InstanceIdentity::for_uid(UID).unwrap();
        assert!(
            self.fake.domains("h1").is_empty(),
            "{:?}",
            self.fake.domains("h1")
        );
        let volumes = self.fake.volumes("h1");
        assert!(
            !volumes.contains(&id.root_volume) && !volumes.contains(&id.seed_volume),
            "the Create left its volumes: {volumes:?}"
        );
    }

    fn seen(&self) -> Vec<&'static str> {
        self.hooked.hook().seen.lock().unwrap().clone()
    }
}

fn run<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn a_lease_lost_before_define_defines_nothing_and_removes_the_volumes_made() {
    run(async {
        let seed = InstanceIdentity::for_uid(UID).unwrap().seed_volume;
        // The lease goes while the seed is uploaded: root and seed exist, nothing defined.
        let w = World::new("volume-upload", seed);

        let e = w.create_fails().await;

        assert!(e.is_lease_lost(), "{e}");
        assert_eq!(e.class(), ErrorClass::Transient);
        assert!(e.to_string().contains("domain define"), "{e}");
        assert!(!w.fence.is_held());
        let seen = w.seen();
        assert!(!seen.contains(&"domain-define"), "{seen:?}");
        assert_eq!(w.fake.calls("domain-define"), 0);
        w.assert_vm_gone();
    });
}

#[test]
fn a_lease_lost_after_define_starts_nothing_and_undefines_the_domain() {
    run(async {
        // The lease goes while the domain is defined (a define names no target): the
        // define lands, the start must not.
        let w = World::new("domain-define", String::new());

        let e = w.create_fails().await;

        assert!(e.is_lease_lost(), "{e}");
        assert!(e.to_string().contains("domain start"), "{e}");
        assert_eq!(w.fake.calls("domain-define"), 1);
        assert_eq!(w.fake.calls("domain-start"), 0, "{:?}", w.seen());
        w.assert_vm_gone();
    });
}

#[test]
fn a_create_whose_lease_holds_runs_through() {
    run(async {
        // The same world, and a hook that never fires: the fence alone changes nothing.
        let w = World::new("never", String::new());
        let req = w.request();
        let i = tokio::time::timeout(HANG_GUARD, w.provider.create(&req))
            .await
            .unwrap()
            .unwrap();
        assert!(w.fence.is_held());
        assert_eq!(w.fake.calls("domain-start"), 1);
        assert_eq!(w.fake.domains("h1").len(), 1, "{:?}", i.id);
    });
}
