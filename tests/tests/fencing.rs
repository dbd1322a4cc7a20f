//! Leader fencing inside a kvm2 Create, against the in-memory fake hosts ([`FakeOps`]): a
//! Create whose replica loses the leader lease part-way checks its fence right before it
//! defines the domain and right before it starts it, fails with a transient "lease lost",
//! and removes what it made, so it never defines or starts over the new leader's Create
//! of the same domain. The lease is lost from inside the Create by an [`OpHook`] on the
//! step before the check. A Create whose step never ends is cancelled by the fence after
//! its grace and cannot clean up: it records what it left in the log.
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

/// Holds every call of `op` about `target` forever, after losing the lease: the replica
/// went while that step was in flight, and the step never ends (a libvirtd that stopped
/// answering).
struct StallAfterLoss {
    op: &'static str,
    target: String,
    lease: watch::Sender<bool>,
}

impl std::fmt::Debug for StallAfterLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallAfterLoss")
            .field("op", &self.op)
            .finish()
    }
}

impl OpHook for StallAfterLoss {
    fn before<'a>(
        &'a self,
        op: &'static str,
        _host: &'a str,
        target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        if op == self.op && target == Some(self.target.as_str()) {
            self.lease.send_replace(false);
            return Box::pin(std::future::pending());
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

/// A log sink for one test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Issue 19, finding 6: a Create the fence cancels after the grace (its step never ended)
/// cannot clean up, since no libvirt call may follow the loss. What it made stays (it
/// carries our mark and the Proxy's UID, for the new leader or the collector), and the
/// replica's log names it: the host, the domain and the volumes made. Before, the dropped
/// Create left them without a word.
#[test]
fn a_create_cancelled_after_the_grace_records_what_it_left() {
    use egress_operator::provider::decorate::Fenced;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let logs = Captured::default();
    let writer = logs.clone();
    let _log = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish()
        .set_default();
    // One thread, so the scoped log sink sees what the dropped Create logs.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let bytes = fake_rig::test_image(512 << 20, 5500);
        let http =
            HttpServer::start(vec![("/img".to_string(), Route::Body(bytes.clone()))]).unwrap();
        let config = FakeConfig::new(&http.url("/img"), &sha256_hex(&bytes))
            .name("fencing-cancelled")
            .build();
        let fake = Arc::new(FakeOps::new(&["h1"], 1 << 40));
        let (lease, rx) = watch::channel(true);
        let id = InstanceIdentity::for_uid(UID).unwrap();
        let hooked = Arc::new(Hooked::wrap(
            fake.clone() as Arc<dyn HostOps>,
            StallAfterLoss {
                op: "volume-create",
                target: id.seed_volume.clone(),
                lease,
            },
        ));
        let mut options = fake_rig::fast_options();
        options.images.max_wait = Duration::from_secs(20);
        let provider = Arc::new(fake_rig::provider_with(
            &config,
            hooked as Arc<dyn HostOps>,
            options,
        ));
        let fenced = Fenced::new(provider, Fence::new(rx), Duration::from_millis(200));
        let req = CreateRequest {
            proxy: ProxyRef {
                namespace: "default".into(),
                name: "office".into(),
                uid: UID.into(),
            },
            spec: ProxySpec {
                provider: "kvm2".into(),
                ..Default::default()
            },
            user_data: None,
            fence: Fence::unfenced(),
        };
        let err = tokio::time::timeout(HANG_GUARD, fenced.create(&req))
            .await
            .expect("the fence ends the Create")
            .unwrap_err();
        assert!(err.is_lease_lost(), "{err}");
        assert!(err.to_string().contains("cancelled"), "{err}");
        // Nothing was cleaned up after the loss: the root volume is still there.
        assert!(
            fake.volumes("h1").contains(&id.root_volume),
            "{:?}",
            fake.volumes("h1")
        );
    });
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("create cancelled before it ended"))
        .unwrap_or_else(|| panic!("no record of what the cancelled Create left:\n{text}"));
    let id = InstanceIdentity::for_uid(UID).unwrap();
    assert!(line.contains("host=h1"), "{line}");
    assert!(line.contains(&id.domain_name), "{line}");
    assert!(line.contains(&id.root_volume), "{line}");
}
