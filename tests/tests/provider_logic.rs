//! The kvm2 provider's own logic against the in-memory fake hosts ([`FakeOps`]), with
//! faults injected by [`FaultyOps`]: placement, adopt-or-refuse, cleanup after failures
//! and crashes, the image cache's marker-volume protocol, racing replicas, half-deleted
//! instances, listing, health and secrets. No daemons, no root: the real template plugins
//! (built by `make plugins`) render, and a loopback HTTP server serves the image.
//!
//! Every test asserts the exact end state of the fake hosts (volume and domain names).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use egress_operator::Classified as _;
use egress_operator::api::proxy::ProxySpec;
use egress_operator::config::{self, ValidConfig};
use egress_operator::error::ErrorClass;
use egress_operator::instance::{
    InstanceIdentity, MetadataMark, image_heartbeat_name, image_marker_name, image_takeover_name,
    image_volume_name,
};
use egress_operator::provider::health::HealthBoard;
use egress_operator::provider::kvm2::backend::{Kvm2Options, Kvm2Provider};
use egress_operator::provider::kvm2::fake::{FAULT_POINTS, FakeOps, FaultyOps, Hooked, OpHook};
use egress_operator::provider::kvm2::image::ImageMetrics;
use egress_operator::provider::kvm2::ops::{Created, HostOps, OpsError, UploadChunks};
use egress_operator::provider::{
    BoxFuture, CreateRequest, InstanceId, InstanceState, Provider, ProviderError, ProxyRef,
    UserData,
};
use egress_operator::templates::{TemplateEngine, TemplateSet};
use integration_tests::fake_rig::{self, FakeConfig};
use integration_tests::http::{HttpServer, Route};
use integration_tests::sha256_hex;
use tokio::sync::Notify;

/// A hang fails the test instead of blocking CI; not a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);
/// A staging volume that has not grown for this long is taken over.
const STALE_AFTER: Duration = Duration::from_millis(300);
/// Plenty of pool space.
const BIG_POOL: u64 = 1 << 40;
/// In the user-data of every request: must never show in an error.
const SECRET: &str = "pw-5f0c9e-never-in-errors";
/// The Create steps [`FaultyOps`] can fail.
const CREATE_POINTS: [&str; 5] = [
    "volume-create",
    "volume-upload",
    "domain-define",
    "domain-start",
    "domain-lookup",
];

fn run<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(HANG_GUARD, f)
            .await
            .expect("hang guard")
    })
}

/// Virtual size of the test image: below the machine type's 1 GiB disk.
const VIRTUAL_SIZE: u64 = 512 << 20;

/// The image the server sends: a qcow2 header of [`VIRTUAL_SIZE`], then a few KB not all
/// alike.
fn image_bytes() -> Arc<Vec<u8>> {
    qcow2_bytes(VIRTUAL_SIZE)
}

fn qcow2_bytes(virtual_size: u64) -> Arc<Vec<u8>> {
    fake_rig::test_image(virtual_size, 5500)
}

/// How a test's world is set up.
#[derive(Debug, Clone, Copy)]
struct Opts {
    /// Hosts the fake knows (the config always has h1 and h2).
    fake_hosts: &'static [&'static str],
    /// Free bytes in every fake pool.
    free: u64,
    /// `maxDomains` of h1.
    h1_max_domains: u32,
    /// Path the image URL points at (`/img` or `/trunc`).
    path: &'static str,
    /// Configure a sha256 that the served bytes do not have.
    wrong_sha: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            fake_hosts: &["h1", "h2"],
            free: BIG_POOL,
            h1_max_domains: 32,
            path: "/img",
            wrong_sha: false,
        }
    }
}

/// An image server, fake hosts, and the config over them.
struct Env {
    http: HttpServer,
    fake: Arc<FakeOps>,
    config: Arc<ValidConfig>,
    bytes: Arc<Vec<u8>>,
    /// sha256 in the config (of the served bytes unless `wrong_sha`).
    sha: String,
}

impl Env {
    fn new() -> Self {
        Self::with(Opts::default())
    }

    fn with(opts: Opts) -> Self {
        let bytes = image_bytes();
        let http = HttpServer::start(vec![
            ("/img".to_string(), Route::Body(bytes.clone())),
            (
                "/trunc".to_string(),
                Route::Truncated {
                    body: Arc::new(bytes[..1000].to_vec()),
                    declared: bytes.len() as u64,
                },
            ),
        ])
        .unwrap();
        let sha = if opts.wrong_sha {
            sha256_hex(b"some other image")
        } else {
            sha256_hex(&bytes)
        };
        let config = test_config(&http.url(opts.path), &sha, opts.h1_max_domains);
        Self {
            http,
            fake: Arc::new(FakeOps::new(opts.fake_hosts, opts.free)),
            config,
            bytes,
            sha,
        }
    }

    /// Requests for the image so far.
    fn hits(&self) -> usize {
        self.http.hits("/img") + self.http.hits("/trunc")
    }

    fn ops(&self) -> Arc<dyn HostOps> {
        self.fake.clone()
    }

    /// A provider over the plain fake hosts.
    fn provider(&self) -> Kvm2Provider {
        provider(&self.config, self.ops())
    }

    /// Base image data volume and its marker.
    /// The cached base image and this cluster's announcement that it uses it.
    fn base(&self) -> BTreeSet<String> {
        names([
            image_volume_name(&self.sha),
            image_marker_name(&self.sha),
            egress_operator::instance::image_use_name("test", None),
        ])
    }

    /// The base image plus root and seed of each UID.
    fn expected(&self, uids: &[&str]) -> BTreeSet<String> {
        let mut v = self.base();
        for u in uids {
            v.extend(vm_volumes(u));
        }
        v
    }

    fn volumes(&self, host: &str) -> BTreeSet<String> {
        self.fake.volumes(host)
    }

    fn domains(&self, host: &str) -> BTreeSet<String> {
        self.fake.domains(host)
    }
}

/// Hosts h1 (with `maxDomains: h1_max_domains`) and h2.
fn test_config(url: &str, sha: &str, h1_max_domains: u32) -> Arc<ValidConfig> {
    FakeConfig::new(url, sha)
        .host("h1", &format!("maxDomains: {h1_max_domains}"))
        .host("h2", "")
        .name("provider-logic-config")
        .build()
}

/// The fake rig's short waits, with a quick takeover of a stale staging volume
/// ([`STALE_AFTER`]), an image wait bounded within the hang guard, and placement that
/// reads `health`.
fn logic_options(health: HealthBoard) -> Kvm2Options {
    let mut options = fake_rig::fast_options();
    options.images.stale_after = STALE_AFTER;
    options.images.max_wait = Duration::from_secs(20);
    options.health = health;
    options
}

/// A provider over `ops` with short waits (mirrors the real rig's `provider()`).
fn provider(config: &Arc<ValidConfig>, ops: Arc<dyn HostOps>) -> Kvm2Provider {
    provider_with_health(config, ops, HealthBoard::default())
}

/// [`provider`] whose placement reads `health`.
fn provider_with_health(
    config: &Arc<ValidConfig>,
    ops: Arc<dyn HostOps>,
    health: HealthBoard,
) -> Kvm2Provider {
    fake_rig::provider_with(config, ops, logic_options(health))
}

/// A valid UID numbered `n`.
fn uid(n: u8) -> String {
    format!("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a6978{n:02x}")
}

fn identity(uid: &str) -> InstanceIdentity {
    InstanceIdentity::for_uid(uid).unwrap()
}

fn dom(uid: &str) -> String {
    identity(uid).domain_name
}

fn vm_volumes(uid: &str) -> [String; 2] {
    let id = identity(uid);
    [id.root_volume, id.seed_volume]
}

fn names<I: IntoIterator<Item = S>, S: Into<String>>(items: I) -> BTreeSet<String> {
    items.into_iter().map(Into::into).collect()
}

/// A Create for Proxy `default/NAME` with this UID, pinned to `host` if given, with
/// user-data carrying [`SECRET`].
fn request(uid: &str, name: &str, host: Option<&str>) -> CreateRequest {
    CreateRequest {
        proxy: ProxyRef {
            namespace: "default".into(),
            name: name.into(),
            uid: uid.into(),
        },
        spec: ProxySpec {
            provider: "kvm2".into(),
            machine_type: None,
            image: None,
            host: host.map(String::from),
            user_data: None,
            template_settings: None,
            update_policy: None,
        },
        user_data: Some(UserData::new(
            format!("#cloud-config\npassword: {SECRET}\n").into_bytes(),
        )),
        fence: egress_operator::provider::Fence::unfenced(),
    }
}

fn mark(cluster: &str, name: &str, uid: &str) -> MetadataMark {
    MetadataMark {
        cluster_id: cluster.into(),
        cluster_uid: None,
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
        created_at: "2026-01-01T00:00:00Z".into(),
        mac: None,
        address: None,
    }
}

/// A minimal domain XML named `name`, with `mark` in its `<metadata>` if given.
fn domain_xml(name: &str, mark: Option<&MetadataMark>) -> String {
    let meta = mark
        .map(|m| format!("<metadata>{}</metadata>", m.to_xml()))
        .unwrap_or_default();
    format!("<domain type='qemu'><name>{name}</name><memory unit='MiB'>128</memory>{meta}</domain>")
}

fn class_of<T: std::fmt::Debug>(r: &Result<T, ProviderError>) -> ErrorClass {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.class(),
    }
}

/// Everything a failure shows: Display, Debug, and the whole source chain.
fn shown(e: &ProviderError) -> String {
    let mut all = format!("{e}\n{e:?}\n{:?}\n", e.inner());
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = cur {
        all.push_str(&format!("{s}\n{s:?}\n"));
        cur = s.source();
    }
    all
}

async fn state(fake: &FakeOps, host: &str, name: &str) -> Option<InstanceState> {
    fake.domain(host, name).await.unwrap().map(|d| d.state)
}

// 1. ------------------------------------------------------------------------------------

#[test]
fn create_adopt_get_delete_round_trip() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let u = uid(1);
        let req = request(&u, "office-egress", Some("h1"));
        let inst = p.create(&req).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(
            inst.id,
            InstanceId {
                host: "h1".into(),
                name: dom(&u)
            }
        );
        assert_eq!(inst.proxy, req.proxy);
        assert_eq!(env.domains("h1"), names([dom(&u)]));
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
        assert!(env.domains("h2").is_empty() && env.volumes("h2").is_empty());
        assert_eq!(
            state(&env.fake, "h1", &dom(&u)).await,
            Some(InstanceState::Running)
        );
        assert_eq!(env.hits(), 1);
        // The verified bytes are what the base volume holds; one image + one seed upload.
        let data = env
            .fake
            .volume_data("h1", &image_volume_name(&env.sha))
            .unwrap();
        assert_eq!(data, *env.bytes);
        assert_eq!(env.fake.uploads(), 2);
        // The seed holds the user-data (the ISO carries the file as is).
        let seed = env
            .fake
            .volume_data("h1", &identity(&u).seed_volume)
            .unwrap();
        assert!(seed.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()));

        // Again: adopted, same ID, nothing downloaded or uploaded again.
        let again = p.create(&req).await.unwrap();
        assert_eq!(again.id, inst.id);
        assert_eq!(again.proxy, inst.proxy);
        assert_eq!(env.hits(), 1);
        assert_eq!(env.fake.uploads(), 2);
        assert_eq!(env.domains("h1"), names([dom(&u)]));
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));

        let got = p.get(&inst.id).await.unwrap();
        assert_eq!(got.state, InstanceState::Running);
        assert_eq!(got.proxy, req.proxy);
        assert_eq!(got.id, inst.id);

        p.delete(&inst.id).await.unwrap();
        assert!(env.domains("h1").is_empty(), "{:?}", env.domains("h1"));
        assert_eq!(env.volumes("h1"), env.base(), "only the base image stays");
        p.delete(&inst.id).await.unwrap();
        assert_eq!(env.volumes("h1"), env.base());
        let e = p.get(&inst.id).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::NotFound, "{e}");
    });
}

// 2. ------------------------------------------------------------------------------------

#[test]
fn placement_prefers_fewer_of_our_domains_and_skips_down_hosts() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        // h1 carries one of ours; h2 carries two that are not ours (no mark, other cluster).
        let (a, b, c, d) = (uid(0x21), uid(0x22), uid(0x23), uid(0x24));
        env.fake.put_domain(
            "h1",
            &dom(&a),
            &domain_xml(&dom(&a), Some(&mark("test", "a", &a))),
            InstanceState::Running,
        );
        env.fake.put_domain(
            "h2",
            "egress-foreign-1",
            &domain_xml("egress-foreign-1", None),
            InstanceState::Running,
        );
        let other = uid(0x99);
        env.fake.put_domain(
            "h2",
            &dom(&other),
            &domain_xml(&dom(&other), Some(&mark("other", "x", &other))),
            InstanceState::Running,
        );
        let inst = p.create(&request(&b, "b", None)).await.unwrap();
        assert_eq!(inst.id.host, "h2", "h2 has none of ours");
        assert_eq!(
            env.domains("h2"),
            names(["egress-foreign-1".to_string(), dom(&other), dom(&b)])
        );
        assert_eq!(env.volumes("h2"), env.expected(&[&b]));
        assert_eq!(env.domains("h1"), names([dom(&a)]));
        assert!(env.volumes("h1").is_empty());

        // Now one each: a tie goes to the first host; with h1 down, h2 it is.
        env.fake.set_down("h1", true);
        let inst = p.create(&request(&c, "c", None)).await.unwrap();
        assert_eq!(inst.id.host, "h2");
        env.fake.set_down("h1", false);
        assert_eq!(env.domains("h1"), names([dom(&a)]));
        assert_eq!(
            env.domains("h2"),
            names([
                "egress-foreign-1".to_string(),
                dom(&other),
                dom(&b),
                dom(&c)
            ])
        );
        assert_eq!(env.volumes("h2"), env.expected(&[&b, &c]));

        // Everything down: transient, and nothing was made anywhere.
        env.fake.set_down("h1", true);
        env.fake.set_down("h2", true);
        let r = p.create(&request(&d, "d", None)).await;
        assert_eq!(class_of(&r), ErrorClass::Transient, "{r:?}");
        env.fake.set_down("h1", false);
        env.fake.set_down("h2", false);
        assert_eq!(env.domains("h1"), names([dom(&a)]));
        assert!(env.volumes("h1").is_empty());
        assert_eq!(env.volumes("h2"), env.expected(&[&b, &c]));
        assert_eq!(env.domains("h2").len(), 4);
    });
}

// 3. ------------------------------------------------------------------------------------

#[test]
fn foreign_domains_are_refused_and_untouched_ours_are_adopted() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let u = uid(0x31);
        let name = dom(&u);
        let foreign = [
            ("no mark", domain_xml(&name, None)),
            (
                "other cluster",
                domain_xml(&name, Some(&mark("other", "office", &u))),
            ),
            // Our cluster's mark for another Proxy under this Proxy's name.
            (
                "other uid",
                domain_xml(&name, Some(&mark("test", "office", &uid(0x32)))),
            ),
        ];
        for (what, xml) in foreign {
            env.fake
                .put_domain("h1", &name, &xml, InstanceState::ShutOff);
            for host in [Some("h1"), None] {
                let r = p.create(&request(&u, "office", host)).await;
                assert_eq!(class_of(&r), ErrorClass::Permanent, "{what}: {r:?}");
                assert_eq!(env.domains("h1"), names([name.clone()]), "{what}");
                let rec = env.fake.domain("h1", &name).await.unwrap().unwrap();
                assert_eq!(rec.state, InstanceState::ShutOff, "{what}: not started");
                assert_eq!(
                    env.fake.domain_xml("h1", &name).await.unwrap(),
                    Some(xml.clone()),
                    "{what}: not redefined"
                );
                assert!(
                    env.volumes("h1").is_empty(),
                    "{what}: {:?}",
                    env.volumes("h1")
                );
                assert!(
                    env.domains("h2").is_empty() && env.volumes("h2").is_empty(),
                    "{what}"
                );
            }
            if what == "other uid" {
                // Delete of this one: see `delete_never_touches_another_proxys_volumes`.
                continue;
            }
            // Delete refuses too, and leaves it.
            let id = InstanceId {
                host: "h1".into(),
                name: name.clone(),
            };
            let r = p.delete(&id).await;
            assert!(
                r.as_ref()
                    .is_err_and(|e| e.class() == ErrorClass::Permanent),
                "{what}: {r:?}"
            );
            assert_eq!(env.domains("h1"), names([name.clone()]));
            // Get does not report someone else's domain as ours: refused, permanently.
            let r = p.get(&id).await;
            assert_eq!(class_of(&r), ErrorClass::Permanent, "{what}: {r:?}");
        }
        assert_eq!(env.hits(), 0);

        // Ours (same cluster, same UID) with its root volume: adopted as it is. Running: a
        // shut-off one is first re-checked like a fresh define (tests/tests/define_check.rs),
        // which this sketch of a domain would not pass.
        let ours = domain_xml(&name, Some(&mark("test", "adopted-name", &u)));
        env.fake
            .put_domain("h1", &name, &ours, InstanceState::Running);
        env.fake
            .put_volume("h1", &identity(&u).root_volume, b"overlay");
        let inst = p.create(&request(&u, "office", Some("h1"))).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(
            inst.id,
            InstanceId {
                host: "h1".into(),
                name: name.clone()
            }
        );
        assert_eq!(inst.proxy.name, "adopted-name", "reported from the mark");
        assert_eq!(inst.created_at, "2026-01-01T00:00:00Z");
        assert_eq!(env.fake.domain_xml("h1", &name).await.unwrap(), Some(ours));
        assert_eq!(env.domains("h1"), names([name.clone()]));
        assert_eq!(env.volumes("h1"), names([identity(&u).root_volume]));
        assert_eq!(env.hits(), 0);
        assert_eq!(env.fake.uploads(), 0);
    });
}

/// A domain named for Proxy A whose (our cluster's) mark names Proxy B: Create refuses it
/// as foreign, but Delete takes the UID from the mark, not from the name, so it removes
/// the domain *and Proxy B's root and seed volumes*, under B's running domain.
#[test]
fn delete_never_touches_another_proxys_volumes() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let (a, b) = (uid(0x34), uid(0x35));
        p.create(&request(&b, "b", Some("h1"))).await.unwrap();
        let xml = domain_xml(&dom(&a), Some(&mark("test", "b", &b)));
        env.fake
            .put_domain("h1", &dom(&a), &xml, InstanceState::Running);
        let id = InstanceId {
            host: "h1".into(),
            name: dom(&a),
        };
        let r = p.delete(&id).await;
        assert_eq!(
            env.volumes("h1"),
            env.expected(&[&b]),
            "Proxy B's volumes (delete of {id} returned {r:?})"
        );
        assert_eq!(env.domains("h1"), names([dom(&a), dom(&b)]));
        assert!(
            r.as_ref()
                .is_err_and(|e| e.class() == ErrorClass::Permanent),
            "refused like Create refuses it: {r:?}"
        );
    });
}

#[test]
fn our_domain_without_its_root_volume_is_replaced() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let u = uid(0x33);
        let name = dom(&u);
        let old = domain_xml(&name, Some(&mark("test", "old", &u)));
        env.fake
            .put_domain("h1", &name, &old, InstanceState::Running);
        let inst = p.create(&request(&u, "office", Some("h1"))).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(inst.proxy.name, "office", "the new mark");
        assert_ne!(env.fake.domain_xml("h1", &name).await.unwrap(), Some(old));
        assert_eq!(env.domains("h1"), names([name]));
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
    });
}

/// Issue 19, finding 7: a replacement removed the domain but not its root volume (the
/// volume delete failed). The next Create must not boot that disk again: cloud-init would
/// see the same instance-id and keep the old network config.
#[test]
fn a_new_incarnation_never_boots_an_old_root_disk() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let u = uid(0x34);
        let id = identity(&u);
        p.create(&request(&u, "office", Some("h1"))).await.unwrap();
        // The old incarnation booted: its disk holds its cloud-init state.
        env.fake.put_volume(
            "h1",
            &id.root_volume,
            b"booted: instance-id and old network",
        );
        env.fake.destroy("h1", &id.domain_name).await.unwrap();
        env.fake.undefine("h1", &id.domain_name).await.unwrap();
        assert!(env.volumes("h1").contains(&id.root_volume));

        let inst = p.create(&request(&u, "office", Some("h1"))).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(
            env.fake.volume_data("h1", &id.root_volume),
            Some(Vec::new()),
            "a fresh overlay, not the booted disk"
        );
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
    });
}

// 4. ------------------------------------------------------------------------------------

/// Fails the `nth` call of `point` (every `nth` a Create reaches, then one more that it
/// does not), and hands each failed world to `check` with the error.
async fn each_fault(crash: bool, mut check: impl AsyncFnMut(&Env, &str, usize, ProviderError)) {
    for point in CREATE_POINTS {
        assert!(FAULT_POINTS.contains(&point), "{point}");
        let mut nth = 0;
        loop {
            let env = Env::new();
            let faulty = Arc::new(FaultyOps::new(env.ops(), point, nth, crash));
            let p = provider(&env.config, faulty.clone());
            let u = uid(0x41);
            let r = p.create(&request(&u, "faulty", Some("h1"))).await;
            if !faulty.tripped() {
                let inst = r.unwrap_or_else(|e| panic!("{point}#{nth} not reached, yet: {e}"));
                assert_eq!(inst.state, InstanceState::Running);
                assert!(nth > 0, "a Create never reaches {point}");
                break;
            }
            let e = r
                .err()
                .unwrap_or_else(|| panic!("{point}#{nth} fired, yet the Create succeeded"));
            check(&env, point, nth, e).await;
            nth += 1;
        }
    }
}

/// After the failure, a Create over healthy hosts converges to exactly one running domain
/// and its volumes, and downloads at most once more.
async fn converges(env: &Env, what: &str, hits_before: usize) {
    let u = uid(0x41);
    let p = env.provider();
    let inst = p
        .create(&request(&u, "faulty", Some("h1")))
        .await
        .unwrap_or_else(|e| panic!("{what}: did not converge: {e}"));
    assert_eq!(inst.state, InstanceState::Running, "{what}");
    assert_eq!(env.domains("h1"), names([dom(&u)]), "{what}");
    assert_eq!(env.volumes("h1"), env.expected(&[&u]), "{what}");
    assert_eq!(
        state(&env.fake, "h1", &dom(&u)).await,
        Some(InstanceState::Running),
        "{what}"
    );
    assert_eq!(
        env.fake
            .volume_data("h1", &image_volume_name(&env.sha))
            .unwrap(),
        *env.bytes,
        "{what}"
    );
    assert!(
        env.hits() <= hits_before + 1,
        "{what}: {} downloads",
        env.hits()
    );
    assert!(
        env.domains("h2").is_empty() && env.volumes("h2").is_empty(),
        "{what}"
    );
}

#[test]
fn a_failed_create_cleans_up_what_it_made_then_converges() {
    run(async {
        let mut cases = 0;
        each_fault(
            false,
            async |env: &Env, point: &str, nth: usize, e: ProviderError| {
                let what = format!("{point}#{nth}");
                assert_eq!(e.class(), ErrorClass::Transient, "{what}: {e}");
                assert!(
                    env.domains("h1").is_empty(),
                    "{what}: {:?}",
                    env.domains("h1")
                );
                // Nothing of the VM; the base image either committed (data + marker, and
                // the announcement unless writing it was what failed) or gone.
                let v = env.volumes("h1");
                let committed = names([image_volume_name(&env.sha), image_marker_name(&env.sha)]);
                assert!(
                    v.is_empty() || v == env.base() || v == committed,
                    "{what}: left {v:?}"
                );
                converges(env, &what, env.hits()).await;
                cases += 1;
            },
        )
        .await;
        assert!(cases >= CREATE_POINTS.len(), "{cases}");
    });
}

// 5. ------------------------------------------------------------------------------------

#[test]
fn after_a_crash_at_any_step_a_fresh_provider_converges() {
    run(async {
        let mut cases = 0;
        each_fault(
            true,
            async |env: &Env, point: &str, nth: usize, e: ProviderError| {
                let what = format!("crash at {point}#{nth}");
                assert_eq!(e.class(), ErrorClass::Transient, "{what}: {e}");
                let started = Instant::now();
                let staging = env.volumes("h1").contains(&image_volume_name(&env.sha))
                    && !env.volumes("h1").contains(&image_marker_name(&env.sha));
                converges(env, &what, env.hits()).await;
                if staging {
                    // A dead uploader's staging volume is taken over, not used, and not early.
                    assert!(started.elapsed() >= STALE_AFTER, "{what}");
                }
                cases += 1;
            },
        )
        .await;
        assert!(cases >= CREATE_POINTS.len(), "{cases}");
    });
}

// 6. ------------------------------------------------------------------------------------

#[test]
fn stale_staging_volume_is_taken_over() {
    let env = Env::new();
    run(async {
        let data = image_volume_name(&env.sha);
        env.fake.put_volume("h1", &data, &env.bytes[..100]);
        let u = uid(0x61);
        let started = Instant::now();
        env.provider()
            .create(&request(&u, "p", Some("h1")))
            .await
            .unwrap();
        assert!(started.elapsed() >= STALE_AFTER);
        assert_eq!(env.hits(), 1);
        assert_eq!(env.fake.uploads(), 2, "one image upload, one seed");
        assert_eq!(env.fake.volume_data("h1", &data).unwrap(), *env.bytes);
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
        assert_eq!(env.domains("h1"), names([dom(&u)]));
    });
}

/// Another replica's live upload on a pool that shows no growth (LVM, RBD: the volume's
/// allocation says nothing): its heartbeat record changes faster than the stale window,
/// so the Create waits for it and uses its commit instead of taking it over.
#[test]
fn a_live_upload_is_waited_for_even_when_its_volume_does_not_grow() {
    let env = Env::new();
    run(async {
        let data = image_volume_name(&env.sha);
        let beat = image_heartbeat_name(&env.sha);
        env.fake.put_volume("h1", &data, &env.bytes[..10]);
        let (fake, bytes, marker) = (
            env.fake.clone(),
            env.bytes.clone(),
            image_marker_name(&env.sha),
        );
        let other = tokio::spawn({
            let data = data.clone();
            async move {
                // Four stale windows of beats; the volume never changes meanwhile.
                for i in 1..=24 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    fake.put_volume("h1", &beat, format!("beat {i}").as_bytes());
                }
                fake.put_volume("h1", &data, &bytes);
                fake.put_volume("h1", &marker, b"");
                assert!(fake.delete_volume("h1", "default", &beat).await.unwrap());
            }
        });
        let u = uid(0x62);
        env.provider()
            .create(&request(&u, "p", Some("h1")))
            .await
            .unwrap();
        other.await.unwrap();
        assert_eq!(env.hits(), 0, "waited for the other uploader");
        assert_eq!(env.fake.uploads(), 1, "the seed only");
        assert_eq!(env.fake.volume_data("h1", &data).unwrap(), *env.bytes);
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
    });
}

#[test]
fn marker_without_data_is_deleted_and_the_image_cached_again() {
    let env = Env::new();
    run(async {
        env.fake.put_volume("h1", &image_marker_name(&env.sha), b"");
        let u = uid(0x63);
        env.provider()
            .create(&request(&u, "p", Some("h1")))
            .await
            .unwrap();
        assert_eq!(env.hits(), 1);
        assert_eq!(
            env.fake
                .volume_data("h1", &image_volume_name(&env.sha))
                .unwrap(),
            *env.bytes
        );
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
    });
}

#[test]
fn committed_image_is_used_without_any_download() {
    let env = Env::new();
    run(async {
        env.fake
            .put_volume("h1", &image_volume_name(&env.sha), &env.bytes);
        env.fake.put_volume("h1", &image_marker_name(&env.sha), b"");
        let u = uid(0x64);
        env.provider()
            .create(&request(&u, "p", Some("h1")))
            .await
            .unwrap();
        assert_eq!(env.hits(), 0);
        assert_eq!(env.fake.uploads(), 1, "the seed only");
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
    });
}

#[test]
fn digest_mismatch_is_permanent_and_leaves_no_volume() {
    let env = Env::with(Opts {
        wrong_sha: true,
        ..Opts::default()
    });
    run(async {
        let r = env
            .provider()
            .create(&request(&uid(0x65), "p", Some("h1")))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
        assert_eq!(env.hits(), 1);
        assert!(env.volumes("h1").is_empty(), "{:?}", env.volumes("h1"));
        assert!(env.domains("h1").is_empty());
    });
}

/// The image module says a failed verification aborts the upload stream, so a volume is
/// never finished with content that did not verify. The digest is only checked in
/// `finish()`, after the producer dropped the channel: the upload completes first.
#[test]
fn digest_mismatch_aborts_the_upload_instead_of_finishing_it() {
    let env = Env::with(Opts {
        wrong_sha: true,
        ..Opts::default()
    });
    run(async {
        let r = env
            .provider()
            .create(&request(&uid(0x65), "p", Some("h1")))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
        assert_eq!(
            env.fake.uploads(),
            0,
            "an unverified image upload ran to the end"
        );
    });
}

#[test]
fn truncated_download_is_transient_and_leaves_no_volume() {
    let env = Env::with(Opts {
        path: "/trunc",
        ..Opts::default()
    });
    run(async {
        let r = env
            .provider()
            .create(&request(&uid(0x66), "p", Some("h1")))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Transient, "{r:?}");
        assert_eq!(env.http.hits("/trunc"), 1);
        assert!(env.volumes("h1").is_empty(), "{:?}", env.volumes("h1"));
        assert!(env.domains("h1").is_empty());
        assert_eq!(env.fake.uploads(), 0);
    });
}

#[test]
fn pool_too_small_is_quota_and_creates_no_volume() {
    let env = Env::with(Opts {
        fake_hosts: &["h1"],
        free: 1000,
        ..Opts::default()
    });
    run(async {
        let r = env
            .provider()
            .create(&request(&uid(0x67), "p", Some("h1")))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Quota, "{r:?}");
        assert!(env.volumes("h1").is_empty(), "{:?}", env.volumes("h1"));
        assert!(env.domains("h1").is_empty());
        assert_eq!(env.fake.uploads(), 0);
    });
}

// 7. ------------------------------------------------------------------------------------

/// Two replicas (own image caches, own locks) over the same hosts.
async fn race_two_replicas(env: &Env) {
    let p1 = Arc::new(env.provider());
    let p2 = Arc::new(env.provider());
    let (a, b) = (uid(0x71), uid(0x72));
    let t1 = tokio::spawn({
        let (p, a) = (p1.clone(), a.clone());
        async move { p.create(&request(&a, "a", Some("h1"))).await }
    });
    let t2 = tokio::spawn({
        let (p, b) = (p2.clone(), b.clone());
        async move { p.create(&request(&b, "b", Some("h1"))).await }
    });
    for t in [t1, t2] {
        let inst = t.await.unwrap().unwrap();
        assert_eq!(inst.state, InstanceState::Running);
    }
    assert_eq!(env.domains("h1"), names([dom(&a), dom(&b)]));
    assert_eq!(env.volumes("h1"), env.expected(&[&a, &b]));
    assert_eq!(
        env.fake
            .volume_data("h1", &image_volume_name(&env.sha))
            .unwrap(),
        *env.bytes
    );
    for u in [&a, &b] {
        assert_eq!(
            state(&env.fake, "h1", &dom(u)).await,
            Some(InstanceState::Running)
        );
    }
}

#[test]
fn racing_replicas_upload_the_image_once() {
    let env = Env::new();
    run(async {
        race_two_replicas(&env).await;
        assert_eq!(
            env.fake.uploads(),
            3,
            "one image upload plus one seed per VM"
        );
        assert!(env.hits() <= 2, "{}", env.hits());
    });
}

// 8. ------------------------------------------------------------------------------------

#[test]
fn delete_finishes_half_deleted_instances() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let (a, b) = (uid(0x81), uid(0x82));
        let ia = p.create(&request(&a, "a", Some("h1"))).await.unwrap();
        let ib = p.create(&request(&b, "b", Some("h1"))).await.unwrap();

        // (a) volumes gone, domain left.
        for v in vm_volumes(&a) {
            assert!(env.fake.delete_volume("h1", "default", &v).await.unwrap());
        }
        p.delete(&ia.id).await.unwrap();
        assert_eq!(env.domains("h1"), names([dom(&b)]));
        assert_eq!(env.volumes("h1"), env.expected(&[&b]));

        // (b) domain gone, volumes left.
        assert!(env.fake.undefine("h1", &dom(&b)).await.unwrap());
        p.delete(&ib.id).await.unwrap();
        assert!(env.domains("h1").is_empty());
        assert_eq!(env.volumes("h1"), env.base());
    });
}

// 9. ------------------------------------------------------------------------------------

#[test]
fn list_reports_a_down_host_as_failed_and_only_our_marked_domains() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        let u = uid(0x91);
        p.create(&request(&u, "ours", Some("h1"))).await.unwrap();
        env.fake.put_domain(
            "h1",
            "egress-not-ours",
            &domain_xml("egress-not-ours", None),
            InstanceState::Running,
        );
        let other = uid(0x92);
        env.fake.put_domain(
            "h1",
            &dom(&other),
            &domain_xml(&dom(&other), Some(&mark("other", "theirs", &other))),
            InstanceState::Running,
        );
        env.fake.put_domain(
            "h1",
            "web",
            &domain_xml("web", Some(&mark("test", "web", &uid(0x93)))),
            InstanceState::Running,
        );
        env.fake.set_down("h2", true);

        let listing = p.list().await;
        let targets: Vec<&str> = listing.iter().map(|l| l.target.as_str()).collect();
        assert_eq!(targets, ["h1", "h2"]);
        let h1 = listing[0].result.as_ref().unwrap();
        assert_eq!(h1.len(), 1, "{h1:?}");
        assert_eq!(
            h1[0].id,
            InstanceId {
                host: "h1".into(),
                name: dom(&u)
            }
        );
        assert_eq!(h1[0].proxy.name, "ours");
        assert_eq!(h1[0].state, InstanceState::Running);
        match &listing[1].result {
            Ok(v) => panic!("a down host listed as Ok({v:?})"),
            Err(e) => assert_eq!(e.class(), ErrorClass::Transient, "{e}"),
        }
        // Nothing was touched by listing.
        assert_eq!(env.domains("h1").len(), 4);
    });
}

// 10. -----------------------------------------------------------------------------------

#[test]
fn a_full_host_refuses_a_pinned_create_with_quota() {
    let env = Env::with(Opts {
        h1_max_domains: 1,
        ..Opts::default()
    });
    run(async {
        let p = env.provider();
        let (a, b, c) = (uid(0xa1), uid(0xa2), uid(0xa3));
        p.create(&request(&a, "a", Some("h1"))).await.unwrap();
        let r = p.create(&request(&b, "b", Some("h1"))).await;
        assert_eq!(class_of(&r), ErrorClass::Quota, "{r:?}");
        assert_eq!(env.domains("h1"), names([dom(&a)]));
        assert_eq!(env.volumes("h1"), env.expected(&[&a]));
        // Adopting the existing one is not blocked by the limit.
        p.create(&request(&a, "a", Some("h1"))).await.unwrap();
        // Unpinned, the full host is skipped.
        let inst = p.create(&request(&c, "c", None)).await.unwrap();
        assert_eq!(inst.id.host, "h2");
        assert_eq!(env.domains("h1"), names([dom(&a)]));
        assert_eq!(env.domains("h2"), names([dom(&c)]));
    });
}

/// `check_room` counts defined domains only, and runs under a semaphore of
/// `maxConcurrentCreates` (2 by default) permits, so two Creates in flight both see room.
#[test]
fn concurrent_pinned_creates_respect_max_domains() {
    let env = Env::with(Opts {
        h1_max_domains: 1,
        ..Opts::default()
    });
    run(async {
        let p = Arc::new(env.provider());
        let tasks: Vec<_> = [uid(0xa4), uid(0xa5)]
            .into_iter()
            .map(|u| {
                let p = p.clone();
                tokio::spawn(async move { p.create(&request(&u, "p", Some("h1"))).await })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => ok += 1,
                Err(e) => assert_eq!(e.class(), ErrorClass::Quota, "{e}"),
            }
        }
        assert_eq!(ok, 1);
        assert_eq!(env.domains("h1").len(), 1, "{:?}", env.domains("h1"));
    });
}

// 11. -----------------------------------------------------------------------------------

#[test]
fn health_reports_a_down_host_with_a_reason() {
    let env = Env::new();
    run(async {
        let p = env.provider();
        env.fake.set_down("h2", true);
        let report = p.health().unwrap().check(Duration::from_secs(2)).await;
        assert_eq!(report.len(), 2);
        let h1 = report.iter().find(|t| t.target == "h1").unwrap();
        assert!(h1.reachable, "{h1:?}");
        assert_eq!(h1.reason, None);
        let h2 = report.iter().find(|t| t.target == "h2").unwrap();
        assert!(!h2.reachable, "{h2:?}");
        assert!(
            h2.reason.as_deref().is_some_and(|r| !r.is_empty()),
            "{h2:?}"
        );
        assert!(!h2.message.is_empty(), "{h2:?}");

        env.fake.set_down("h2", false);
        let report = p.health().unwrap().check(Duration::from_secs(2)).await;
        assert!(report.iter().all(|t| t.reachable), "{report:?}");
    });
}

// 12. -----------------------------------------------------------------------------------

#[test]
fn user_data_never_appears_in_errors() {
    run(async {
        let mut errors: Vec<(String, ProviderError)> = Vec::new();
        // Faults at every step of a Create that runs after the user-data is read.
        for (point, nth) in [
            ("volume-upload", 1), // the seed upload
            ("volume-create", 3), // the seed volume
            ("domain-define", 0),
            ("domain-start", 0),
            ("domain-lookup", 1),
        ] {
            let env = Env::new();
            let faulty = Arc::new(FaultyOps::new(env.ops(), point, nth, false));
            let p = provider(&env.config, faulty.clone());
            let r = p.create(&request(&uid(0xc1), "s", Some("h1"))).await;
            assert!(faulty.tripped(), "{point}#{nth}");
            errors.push((format!("{point}#{nth}"), r.unwrap_err()));
        }
        // A refused foreign domain, a bad image, and user-data too large for the seed.
        let env = Env::new();
        let u = uid(0xc2);
        env.fake.put_domain(
            "h1",
            &dom(&u),
            &domain_xml(&dom(&u), None),
            InstanceState::Running,
        );
        let r = env.provider().create(&request(&u, "s", Some("h1"))).await;
        errors.push(("foreign".into(), r.unwrap_err()));
        let env = Env::with(Opts {
            wrong_sha: true,
            ..Opts::default()
        });
        let r = env
            .provider()
            .create(&request(&uid(0xc3), "s", Some("h1")))
            .await;
        errors.push(("digest".into(), r.unwrap_err()));
        let env = Env::new();
        let mut big = request(&uid(0xc4), "s", Some("h1"));
        let huge = format!(
            "#cloud-config\n{}",
            format!("password: {SECRET}\n").repeat(200_000)
        );
        big.user_data = Some(UserData::new(huge.into_bytes()));
        assert!(!format!("{big:?}").contains(SECRET));
        let r = env.provider().create(&big).await;
        assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
        assert_eq!(
            env.volumes("h1"),
            env.base(),
            "the root overlay was removed"
        );
        errors.push(("oversize".into(), r.unwrap_err()));

        for (what, e) in &errors {
            let text = shown(e);
            assert!(!text.contains(SECRET), "{what}: {text}");
        }
    });
}

// Extra: two replicas taking over the same dead staging volume. ------------------------

/// A pause point: the first call that matches says `reached` and waits for `go`.
struct Pause {
    volume: String,
    armed: AtomicBool,
    reached: Arc<Notify>,
    go: Arc<Notify>,
}

impl Pause {
    fn new(volume: &str) -> (Arc<Self>, Arc<Notify>, Arc<Notify>) {
        let (reached, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let p = Arc::new(Self {
            volume: volume.into(),
            armed: AtomicBool::new(true),
            reached: reached.clone(),
            go: go.clone(),
        });
        (p, reached, go)
    }

    async fn maybe(pause: &Option<Arc<Self>>, volume: &str) {
        if let Some(p) = pause
            && p.volume == volume
            && p.armed.swap(false, Ordering::SeqCst)
        {
            p.reached.notify_one();
            p.go.notified().await;
        }
    }
}

/// What the host holds besides the fake's state: a generation per volume name, bumped
/// whenever a volume of that name is created.
#[derive(Default)]
struct HostSide {
    generations: Mutex<HashMap<String, u64>>,
    /// For every marker this view committed: whether the data volume then held exactly the
    /// verified image.
    commits: Mutex<Vec<bool>>,
    /// For every heartbeat read (a waiter watching another's upload): whether the
    /// takeover claim existed then.
    claim_while_watching: Mutex<Vec<bool>>,
}

impl HostSide {
    fn generation(&self, name: &str) -> u64 {
        self.generations
            .lock()
            .unwrap()
            .get(name)
            .copied()
            .unwrap_or(0)
    }
}

/// One replica's view of the shared fake hosts, with pause points, and libvirt's stream
/// semantics: an upload writes into the volume it opened, so if that volume was deleted
/// and a new one of the same name created meanwhile, the bytes go to the deleted file and
/// the upload still reports success.
struct ReplicaView {
    inner: Arc<FakeOps>,
    side: Arc<HostSide>,
    pause_delete: Option<Arc<Pause>>,
    pause_upload: Option<Arc<Pause>>,
    /// Pauses the first create of this volume.
    pause_create: Option<Arc<Pause>>,
    /// After the upload pause, fail the upload (the stream broke) instead of finishing it.
    fail_upload: bool,
    /// (marker, data, verified bytes).
    image: (String, String, Arc<Vec<u8>>),
}

impl ReplicaView {
    /// The fake hosts as this replica sees them.
    fn ops(self) -> Arc<Hooked<Self>> {
        Arc::new(Hooked::wrap(self.inner.clone(), self))
    }
}

impl OpHook for ReplicaView {
    fn before<'a>(
        &'a self,
        op: &'static str,
        host: &'a str,
        target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            match (op, target) {
                ("volume-delete", Some(name)) => Pause::maybe(&self.pause_delete, name).await,
                ("volume-create", Some(name)) => Pause::maybe(&self.pause_create, name).await,
                ("volume-read", Some(_)) => {
                    let claim = self.image.1.replace("-image-", "-imgtk-");
                    let held = self.inner.volumes(host).contains(&claim);
                    self.side.claim_while_watching.lock().unwrap().push(held);
                }
                _ => {}
            }
            Ok(())
        })
    }
    fn after_create_volume(&self, host: &str, name: &str, created: Created) {
        if created == Created::Created {
            *self
                .side
                .generations
                .lock()
                .unwrap()
                .entry(name.into())
                .or_default() += 1;
            let (marker, data, bytes) = &self.image;
            if name == marker {
                let held = self.inner.volume_data(host, data);
                self.side
                    .commits
                    .lock()
                    .unwrap()
                    .push(held.as_deref() == Some(bytes.as_slice()));
            }
        }
    }
    fn upload_chunks<'a>(
        &'a self,
        _host: &'a str,
        name: &'a str,
        mut chunks: UploadChunks,
    ) -> BoxFuture<'a, Option<UploadChunks>> {
        Box::pin(async move {
            let opened = self.side.generation(name);
            let mut all = Vec::new();
            while let Some(c) = chunks.recv().await {
                all.push(c);
            }
            Pause::maybe(&self.pause_upload, name).await;
            if self.fail_upload {
                all.push(Err("the stream broke".into()));
            } else if self.side.generation(name) != opened {
                // The opened volume was deleted: the bytes went to an unlinked file.
                return None;
            }
            let (tx, rx) = tokio::sync::mpsc::channel(all.len().max(1));
            for c in all {
                tx.try_send(c).unwrap();
            }
            Some(rx)
        })
    }
}

/// The emulated stream semantics themselves: without any race, a Create through a view
/// commits only verified content (so the test below fails for the race alone).
#[test]
fn replica_view_commits_verified_content_without_a_race() {
    let env = Env::new();
    run(async {
        let side = Arc::new(HostSide::default());
        let view = ReplicaView {
            inner: env.fake.clone(),
            side: side.clone(),
            pause_delete: None,
            pause_upload: None,
            pause_create: None,
            fail_upload: false,
            image: (
                image_marker_name(&env.sha),
                image_volume_name(&env.sha),
                env.bytes.clone(),
            ),
        };
        let u = uid(0xd0);
        provider(&env.config, view.ops())
            .create(&request(&u, "a", Some("h1")))
            .await
            .unwrap();
        assert_eq!(*side.commits.lock().unwrap(), [true]);
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
    });
}

/// Two replicas wait on the same dead staging volume. Replica 2 decides it is stale and is
/// about to delete it; replica 1 decides the same, deletes it, claims a new data volume
/// and streams the image. Replica 2's delete then removes replica 1's *new* volume (the
/// delete is by name, not by the volume it watched) and claims its own. Replica 1's
/// upload went into the deleted volume, yet it commits the marker: the marker now vouches
/// for replica 2's volume, which is still empty, and replica 1's VM gets an overlay over
/// it (invariant 4: a base volume is used only after its content was verified).
///
/// The protocol closes this with the owner token in the heartbeat: replica 1 (the second
/// taker) writes its token before it deletes anything, replica 2's late delete still lands
/// (nothing can fence a call already in flight), but replica 2 then creates the volume
/// afresh and writes its own token, so replica 1 finds another owner at commit and does not
/// commit. Replica 2, frozen in its upload past a stale window, is taken over in turn by
/// replica 1, whose second upload commits; replica 2 finds its upload superseded. Both
/// Creates succeed over the one verified image. Before the heartbeat, replica 1 committed
/// a marker over replica 2's empty volume.
#[test]
fn racing_takeovers_never_commit_an_unwritten_image() {
    let env = Env::new();
    run(async {
        let (marker, data) = (image_marker_name(&env.sha), image_volume_name(&env.sha));
        // A dead uploader's leftovers.
        env.fake.put_volume("h1", &data, &env.bytes[..100]);
        let side = Arc::new(HostSide::default());
        let (pause_delete2, at_delete2, go_delete2) = Pause::new(&data);
        let (pause_upload2, at_upload2, go_upload2) = Pause::new(&data);
        let (pause_upload1, at_upload1, go_upload1) = Pause::new(&data);
        let view = |pause_delete, pause_upload| ReplicaView {
            inner: env.fake.clone(),
            side: side.clone(),
            pause_delete,
            pause_upload,
            pause_create: None,
            fail_upload: false,
            image: (marker.clone(), data.clone(), env.bytes.clone()),
        };
        let p1 = Arc::new(provider(&env.config, view(None, Some(pause_upload1)).ops()));
        let p2 = Arc::new(provider(
            &env.config,
            view(Some(pause_delete2), Some(pause_upload2)).ops(),
        ));
        let (a, b) = (uid(0xd1), uid(0xd2));
        let t2 = tokio::spawn({
            let (p, b) = (p2.clone(), b.clone());
            async move { p.create(&request(&b, "b", Some("h1"))).await }
        });
        at_delete2.notified().await; // replica 2: "stale, deleting"
        let t1 = tokio::spawn({
            let (p, a) = (p1.clone(), a.clone());
            async move { p.create(&request(&a, "a", Some("h1"))).await }
        });
        at_upload1.notified().await; // replica 1 took over and streamed the image
        go_delete2.notify_one(); // replica 2 deletes replica 1's new volume, claims its own
        at_upload2.notified().await;
        go_upload1.notify_one(); // replica 1 finishes into the deleted volume and commits
        let r1 = t1.await.unwrap();
        go_upload2.notify_one();
        let r2 = t2.await.unwrap();
        let commits = side.commits.lock().unwrap().clone();
        assert!(
            commits.iter().all(|ok| *ok),
            "a marker was committed over a data volume that did not hold the verified image \
             (commits: {commits:?}; replica 1: {r1:?}; replica 2: {r2:?})"
        );
        assert_eq!(commits.len(), 1, "one commit: {commits:?}");
        assert!(
            r1.is_ok() && r2.is_ok(),
            "replica 1: {r1:?}; replica 2: {r2:?}"
        );
        assert_eq!(env.fake.volume_data("h1", &data).unwrap(), *env.bytes);
        assert_eq!(env.volumes("h1"), env.expected(&[&a, &b]));
    });
}

/// A replica's view for the tests below: no pauses unless set.
fn view(env: &Env, side: &Arc<HostSide>) -> ReplicaView {
    ReplicaView {
        inner: env.fake.clone(),
        side: side.clone(),
        pause_delete: None,
        pause_upload: None,
        pause_create: None,
        fail_upload: false,
        image: (
            image_marker_name(&env.sha),
            image_volume_name(&env.sha),
            env.bytes.clone(),
        ),
    }
}

/// Polls `cond` until it holds (a hang guard, not a timing assertion).
async fn until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..2500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("never happened: {what}");
}

/// A taker (claim held, dead volume deleted) loses the data volume's create to a fresh
/// uploader. It releases its claim at once and waits for the fresh upload, which commits:
/// both Creates succeed on one download. Before, the taker kept its claim while it waited
/// and the fresh uploader, finding the claim at commit, took itself for taken over and
/// failed.
#[test]
fn a_taker_that_loses_the_data_volume_releases_its_claim() {
    let env = Env::new();
    run(async {
        let (data, claim) = (image_volume_name(&env.sha), image_takeover_name(&env.sha));
        env.fake.put_volume("h1", &data, &env.bytes[..100]);
        let side = Arc::new(HostSide::default());
        let (pause_create, at_create, go_create) = Pause::new(&data);
        let taker = provider(
            &env.config,
            ReplicaView {
                pause_create: Some(pause_create),
                ..view(&env, &side)
            }
            .ops(),
        );
        let (pause_upload, at_upload, go_upload) = Pause::new(&data);
        let fresh = provider(
            &env.config,
            ReplicaView {
                pause_upload: Some(pause_upload),
                ..view(&env, &side)
            }
            .ops(),
        );
        let (a, b) = (uid(0xe1), uid(0xe2));
        let t_taker = tokio::spawn({
            let a = a.clone();
            async move { taker.create(&request(&a, "a", Some("h1"))).await }
        });
        at_create.notified().await; // claimed, dead volume deleted, about to create it
        assert!(env.volumes("h1").contains(&claim));
        assert!(!env.volumes("h1").contains(&data));
        let t_fresh = tokio::spawn({
            let b = b.clone();
            async move { fresh.create(&request(&b, "b", Some("h1"))).await }
        });
        at_upload.notified().await; // the fresh uploader streamed, not yet finished
        let watched_before = side.claim_while_watching.lock().unwrap().len();
        go_create.notify_one(); // the taker's create finds the fresh volume
        until("the taker watches the fresh upload", || {
            side.claim_while_watching.lock().unwrap().len() > watched_before
        })
        .await;
        go_upload.notify_one();
        let (ra, rb) = (t_taker.await.unwrap(), t_fresh.await.unwrap());
        assert!(ra.is_ok() && rb.is_ok(), "taker: {ra:?}; fresh: {rb:?}");
        let watched = side.claim_while_watching.lock().unwrap().clone();
        assert!(
            !watched[watched_before..].iter().any(|held| *held),
            "the taker kept its claim while it waited: {watched:?}"
        );
        assert_eq!(*side.commits.lock().unwrap(), [true]);
        assert_eq!(env.hits(), 1, "one download");
        assert_eq!(env.volumes("h1"), env.expected(&[&a, &b]));
    });
}

/// An uploader stalls (its heartbeat stops), a waiter takes over and commits; then the
/// stalled uploader's stream fails. It must not clean up: the volume it would delete is
/// the committed image now. Before, it deleted it (the taker had released its claim, the
/// only thing the late uploader looked at).
#[test]
fn a_late_failing_uploader_never_deletes_the_committed_image() {
    let env = Env::new();
    run(async {
        let (data, marker) = (image_volume_name(&env.sha), image_marker_name(&env.sha));
        let side = Arc::new(HostSide::default());
        let (pause_upload, at_upload, go_upload) = Pause::new(&data);
        let late = provider(
            &env.config,
            ReplicaView {
                pause_upload: Some(pause_upload),
                fail_upload: true,
                ..view(&env, &side)
            }
            .ops(),
        );
        let (a, b) = (uid(0xe3), uid(0xe4));
        let t_late = tokio::spawn({
            let a = a.clone();
            async move { late.create(&request(&a, "a", Some("h1"))).await }
        });
        at_upload.notified().await; // streamed, then frozen before finishing
        // A second replica judges it dead, takes over, commits and runs its VM.
        env.provider()
            .create(&request(&b, "b", Some("h1")))
            .await
            .unwrap();
        assert!(env.volumes("h1").contains(&marker));
        go_upload.notify_one(); // the frozen upload wakes up and fails
        let r = t_late.await.unwrap();
        assert!(r.is_err(), "the broken upload reported success: {r:?}");
        assert_eq!(
            env.fake.volume_data("h1", &data).as_deref(),
            Some(env.bytes.as_slice()),
            "the committed image was deleted or changed by the late uploader"
        );
        assert_eq!(env.volumes("h1"), env.expected(&[&b]));
    });
}

/// An uploader whose heartbeat record was taken (another replica judged it dead and
/// wrote its own token) finds that at its next beat: it aborts its stream instead of
/// finishing it, deletes nothing, and waits for the new owner's commit, which its Create
/// then uses.
#[test]
fn an_uploader_that_finds_another_token_aborts_and_waits_for_the_new_owner() {
    let mut env = Env::new();
    env.http = HttpServer::start(vec![(
        "/img".to_string(),
        Route::Slow {
            body: env.bytes.clone(),
            chunk: 300,
            pause: Duration::from_millis(50),
        },
    )])
    .unwrap();
    env.config = test_config(&env.http.url("/img"), &env.sha, 32);
    run(async {
        let (data, marker, beat) = (
            image_volume_name(&env.sha),
            image_marker_name(&env.sha),
            image_heartbeat_name(&env.sha),
        );
        let u = uid(0xea);
        let p = env.provider();
        let create = tokio::spawn(async move { p.create(&request(&u, "p", Some("h1"))).await });
        until("the upload is under way", || {
            env.fake
                .volume_data("h1", &beat)
                .is_some_and(|b| !b.is_empty())
        })
        .await;
        env.fake.put_volume("h1", &beat, b"another replica's token");
        // The uploader notices at its next beat, then waits, reading the heartbeat.
        let reads = env.fake.calls("volume-read");
        until("the uploader waits for the new owner", || {
            env.fake.calls("volume-read") >= reads + 3
        })
        .await;
        assert!(env.volumes("h1").contains(&data), "it deleted the volume");
        assert!(!env.volumes("h1").contains(&marker), "it committed");
        // The new owner commits.
        env.fake.put_volume("h1", &data, &env.bytes);
        env.fake.put_volume("h1", &marker, b"");
        env.fake
            .delete_volume("h1", "default", &beat)
            .await
            .unwrap();
        create.await.unwrap().unwrap();
        assert_eq!(
            env.fake.uploads(),
            1,
            "the seed only: the image stream was aborted"
        );
        assert_eq!(env.hits(), 1);
    });
}

// Overlay size and the image's virtual size. --------------------------------------------

/// The root overlay's capacity in the fake (parsed from the volume XML).
async fn capacity_of(env: &Env, name: &str) -> u64 {
    env.fake
        .volume("h1", "default", name)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("no volume {name}"))
        .capacity
}

/// The marker records the qcow2 header's virtual size; the overlay is the machine type's
/// disk (1 GiB), not the base volume's file size (a few KB).
#[test]
fn the_marker_records_the_virtual_size_and_the_overlay_is_the_requested_disk() {
    let env = Env::new();
    run(async {
        let u = uid(0xe5);
        env.provider()
            .create(&request(&u, "p", Some("h1")))
            .await
            .unwrap();
        assert_eq!(
            capacity_of(&env, &image_marker_name(&env.sha)).await,
            VIRTUAL_SIZE
        );
        assert_eq!(capacity_of(&env, &identity(&u).root_volume).await, 1 << 30);
    });
}

/// An image whose virtual size (3 GiB) exceeds the machine type's disk (1 GiB): refused,
/// permanently, naming both sizes, and no overlay is left. A second Create (a restarted
/// operator: a fresh provider) finds the size in the marker and refuses without
/// downloading.
#[test]
fn a_machine_type_smaller_than_the_image_is_refused_naming_both_sizes() {
    let mut env = Env::new();
    let big = qcow2_bytes(3 << 30);
    env.http = HttpServer::start(vec![("/img".to_string(), Route::Body(big.clone()))]).unwrap();
    env.sha = sha256_hex(&big);
    env.config = test_config(&env.http.url("/img"), &env.sha, 32);
    run(async {
        for n in [0xe6, 0xe7] {
            let r = env
                .provider()
                .create(&request(&uid(n), "p", Some("h1")))
                .await;
            assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
            let text = shown(&r.unwrap_err());
            for part in ["\"small\"", "(1 GiB)", "3221225472", "(3 GiB)"] {
                assert!(text.contains(part), "{part}: {text}");
            }
            assert_eq!(
                env.volumes("h1"),
                env.base(),
                "only the cached image is left"
            );
            assert!(env.domains("h1").is_empty());
        }
        assert_eq!(
            env.hits(),
            1,
            "the second Create read the size from the marker"
        );
    });
}

/// A marker written before the virtual size was recorded (capacity 0): the overlay falls
/// back to the base volume's size as floor, as before, and the Create succeeds.
#[test]
fn a_marker_without_a_recorded_size_falls_back_to_the_base_size() {
    let env = Env::new();
    run(async {
        env.fake
            .put_volume("h1", &image_volume_name(&env.sha), &env.bytes);
        env.fake.put_volume("h1", &image_marker_name(&env.sha), b"");
        let u = uid(0xe8);
        env.provider()
            .create(&request(&u, "p", Some("h1")))
            .await
            .unwrap();
        assert_eq!(env.hits(), 0);
        assert_eq!(capacity_of(&env, &identity(&u).root_volume).await, 1 << 30);
    });
}

/// An image configured as qcow2 whose content is something else: a permanent error that
/// says so, and nothing is kept (not even the verified bytes: they are not a usable base).
#[test]
fn an_image_that_is_not_qcow2_is_refused_and_not_kept() {
    let mut env = Env::new();
    let raw: Arc<Vec<u8>> = Arc::new(vec![0x55; 4096]);
    env.http = HttpServer::start(vec![("/img".to_string(), Route::Body(raw.clone()))]).unwrap();
    env.sha = sha256_hex(&raw);
    env.config = test_config(&env.http.url("/img"), &env.sha, 32);
    run(async {
        let r = env
            .provider()
            .create(&request(&uid(0xe9), "p", Some("h1")))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
        let text = shown(&r.unwrap_err());
        assert!(text.contains("configured as qcow2"), "{text}");
        assert!(text.contains("qcow2 magic"), "{text}");
        assert!(env.volumes("h1").is_empty(), "{:?}", env.volumes("h1"));
    });
}

// Placement and the health board. ------------------------------------------------------

/// Marks `hosts` unreachable on `board`, as a health round that found them down would.
fn mark_unhealthy(board: &HealthBoard, hosts: &[&str]) {
    let results: Vec<_> = hosts
        .iter()
        .map(|h| egress_operator::provider::TargetHealth {
            target: h.to_string(),
            reachable: false,
            reason: Some("connect".into()),
            stage: None,
            message: "connection refused".into(),
            latency: Duration::from_millis(1),
        })
        .collect();
    board.record(&results);
}

/// The fake hosts, except that calls to the `dead` hosts that read domains never answer
/// (as a host behind a dead link would, until its deadline), and are counted.
struct DeadHosts {
    dead: BTreeSet<String>,
    listings: Mutex<Vec<String>>,
}

impl DeadHosts {
    fn new(inner: Arc<FakeOps>, dead: &[&str]) -> Hooked<Self> {
        Hooked::wrap(
            inner,
            Self {
                dead: names(dead.iter().copied()),
                listings: Mutex::default(),
            },
        )
    }

    /// Hosts whose domains were listed, in order.
    fn listings(&self) -> Vec<String> {
        self.listings.lock().unwrap().clone()
    }
}

impl OpHook for DeadHosts {
    fn before<'a>(
        &'a self,
        op: &'static str,
        host: &'a str,
        _target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        Box::pin(async move {
            if op == "domain-list" {
                self.listings.lock().unwrap().push(host.to_string());
            }
            if matches!(op, "domain-list" | "domain-lookup") && self.dead.contains(host) {
                std::future::pending::<()>().await;
            }
            Ok(())
        })
    }
}

/// h1 would win the tie, but the board marks it unhealthy and its calls never answer:
/// the Create goes to h2 without waiting on h1, which is not even listed.
#[test]
fn an_unhealthy_host_is_skipped_without_waiting_on_it() {
    let env = Env::new();
    run(async {
        let board = HealthBoard::new();
        mark_unhealthy(&board, &["h1"]);
        let ops = Arc::new(DeadHosts::new(env.fake.clone(), &["h1"]));
        let p = provider_with_health(&env.config, ops.clone(), board.clone());
        let (a, b) = (uid(0xd1), uid(0xd2));
        let inst = p.create(&request(&a, "a", None)).await.unwrap();
        assert_eq!(inst.id.host, "h2");
        // h2 is listed for placement and again for its room check; h1 never.
        assert!(
            ops.hook().listings().iter().all(|h| h == "h2"),
            "{:?}",
            ops.hook().listings()
        );
        assert!(env.domains("h1").is_empty() && env.volumes("h1").is_empty());
        assert_eq!(env.domains("h2"), names([dom(&a)]));

        // Back to healthy: h1 has fewer of ours now, and gets the next one.
        board.record(&[egress_operator::provider::TargetHealth {
            target: "h1".into(),
            reachable: true,
            reason: None,
            stage: None,
            message: "ok".into(),
            latency: Duration::from_millis(1),
        }]);
        let p = provider_with_health(&env.config, env.ops(), board);
        let inst = p.create(&request(&b, "b", None)).await.unwrap();
        assert_eq!(inst.id.host, "h1");
        assert_eq!(env.domains("h1"), names([dom(&b)]));
    });
}

#[test]
fn a_pinned_create_goes_to_its_host_even_when_marked_unhealthy() {
    let env = Env::new();
    run(async {
        let board = HealthBoard::new();
        mark_unhealthy(&board, &["h1", "h2"]);
        let p = provider_with_health(&env.config, env.ops(), board);
        let u = uid(0xd3);
        let inst = p.create(&request(&u, "a", Some("h1"))).await.unwrap();
        assert_eq!(inst.id.host, "h1");
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(env.domains("h1"), names([dom(&u)]));
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
        assert!(env.domains("h2").is_empty());
    });
}

/// Every host unhealthy: a transient error naming each host and why, and nothing made.
#[test]
fn every_host_unhealthy_is_a_transient_error_naming_them() {
    let env = Env::new();
    run(async {
        let board = HealthBoard::new();
        mark_unhealthy(&board, &["h1", "h2"]);
        let ops = Arc::new(DeadHosts::new(env.fake.clone(), &["h1", "h2"]));
        let p = provider_with_health(&env.config, ops.clone(), board);
        let r = p.create(&request(&uid(0xd4), "a", None)).await;
        assert_eq!(class_of(&r), ErrorClass::Transient, "{r:?}");
        let text = r.unwrap_err().to_string();
        for host in ["h1: unhealthy (connect)", "h2: unhealthy (connect)"] {
            assert!(text.contains(host), "{text}");
        }
        assert!(
            ops.hook().listings().is_empty(),
            "{:?}",
            ops.hook().listings()
        );
        for h in ["h1", "h2"] {
            assert!(env.domains(h).is_empty() && env.volumes(h).is_empty());
        }
        assert_eq!(env.hits(), 0, "no image download");
    });
}

/// The only host with room is unhealthy and the healthy one is full: transient (health
/// changes every round), not quota.
#[test]
fn a_full_healthy_host_and_an_unhealthy_one_is_transient() {
    let env = Env::with(Opts {
        h1_max_domains: 1,
        ..Opts::default()
    });
    run(async {
        let a = uid(0xd5);
        env.fake.put_domain(
            "h1",
            &dom(&a),
            &domain_xml(&dom(&a), Some(&mark("test", "a", &a))),
            InstanceState::Running,
        );
        let board = HealthBoard::new();
        mark_unhealthy(&board, &["h2"]);
        let p = provider_with_health(&env.config, env.ops(), board);
        let r = p.create(&request(&uid(0xd6), "b", None)).await;
        assert_eq!(class_of(&r), ErrorClass::Transient, "{r:?}");
        let text = r.unwrap_err().to_string();
        assert!(text.contains("h2: unhealthy (connect)"), "{text}");
        assert!(text.contains("maxDomains"), "{text}");
        assert_eq!(env.domains("h1"), names([dom(&a)]));
        assert!(env.domains("h2").is_empty() && env.volumes("h2").is_empty());
    });
}

/// Our domain sits on a host marked unhealthy that still answers: it is adopted there,
/// not duplicated on the healthy host.
#[test]
fn our_domain_on_a_host_marked_unhealthy_is_adopted_not_duplicated() {
    let env = Env::new();
    run(async {
        let u = uid(0xd7);
        let id = identity(&u);
        env.fake.put_domain(
            "h1",
            &id.domain_name,
            &domain_xml(&id.domain_name, Some(&mark("test", "a", &u))),
            InstanceState::Running,
        );
        env.fake.put_volume("h1", &id.root_volume, b"root");
        let board = HealthBoard::new();
        mark_unhealthy(&board, &["h1"]);
        let ops = Arc::new(DeadHosts::new(env.fake.clone(), &[]));
        let p = provider_with_health(&env.config, ops.clone(), board);
        let inst = p.create(&request(&u, "a", None)).await.unwrap();
        assert_eq!(inst.id.host, "h1");
        assert_eq!(inst.id.name, id.domain_name);
        assert_eq!(
            ops.hook().listings(),
            vec!["h2".to_string()],
            "h1 is not listed"
        );
        assert!(env.domains("h2").is_empty() && env.volumes("h2").is_empty());
        assert_eq!(env.domains("h1"), names([id.domain_name.clone()]));
        assert_eq!(env.hits(), 0, "adopted: nothing downloaded");
    });
}

// Per-Proxy settings overrides (spec.templateSettings). ---------------------------------

/// `env`'s config with `listenPort` overridable in the vendor-data plugin, and a provider
/// whose plugins were loaded from that config.
fn provider_with_overridable_port(env: &Env) -> Kvm2Provider {
    let mut c = (**env.config).clone();
    c.kvm2.templates.vendor_data.overridable_settings = vec!["listenPort".into()];
    // JSON is YAML: the same loader (and its validation) reads it back.
    let text = serde_json::to_string(&c).unwrap();
    let config = Arc::new(config::parse(&text, "overrides", std::path::Path::new("/")).unwrap());
    assert_eq!(
        config.kvm2.templates.vendor_data.overridable_settings,
        ["listenPort"]
    );
    static ENGINE: OnceLock<TemplateEngine> = OnceLock::new();
    let engine = ENGINE.get_or_init(|| TemplateEngine::new(None).unwrap());
    let set = TemplateSet::load(engine, &config.kvm2.templates);
    assert!(set.is_healthy(), "{:?}", set.health());
    let options = logic_options(HealthBoard::default());
    Kvm2Provider::new(
        config,
        env.ops(),
        Arc::new(set),
        options,
        ImageMetrics::default(),
    )
}

/// [`request`] with `overrides` as `spec.templateSettings.vendorData`.
fn request_overriding(uid: &str, overrides: serde_json::Value) -> CreateRequest {
    let mut req = request(uid, "tuned", Some("h1"));
    req.spec.template_settings = Some(egress_operator::api::proxy::TemplateSettingsOverrides {
        domain: None,
        vendor_data: Some(serde_json::from_value(overrides).unwrap()),
    });
    req
}

fn seed_has(env: &Env, uid: &str, text: &str) -> bool {
    let seed = env
        .fake
        .volume_data("h1", &identity(uid).seed_volume)
        .unwrap();
    seed.windows(text.len()).any(|w| w == text.as_bytes())
}

#[test]
fn an_allowed_override_is_rendered_into_the_seed_and_a_refused_one_creates_nothing() {
    run(async {
        // Allowed: the seed's vendor-data carries the Proxy's port, not the config's.
        let env = Env::new();
        let p = provider_with_overridable_port(&env);
        let u = uid(0xd1);
        let inst = p
            .create(&request_overriding(
                &u,
                serde_json::json!({"listenPort": 4242}),
            ))
            .await
            .unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(env.volumes("h1"), env.expected(&[&u]));
        assert!(
            seed_has(&env, &u, "Port 4242"),
            "the override is not in the seed"
        );
        assert!(
            !seed_has(&env, &u, "Port 3128"),
            "the configured port is in the seed"
        );
        // The same Proxy without overrides gets the configured port.
        let plain = uid(0xd2);
        p.create(&request(&plain, "plain", Some("h1")))
            .await
            .unwrap();
        assert!(seed_has(&env, &plain, "Port 3128"));

        // A key the config does not list: refused before anything is made or fetched.
        let env = Env::new();
        let p = provider_with_overridable_port(&env);
        let r = p
            .create(&request_overriding(
                &uid(0xd3),
                serde_json::json!({"maxClients": 5}),
            ))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
        let text = shown(&r.unwrap_err());
        assert!(
            text.contains("spec.templateSettings.vendorData.maxClients"),
            "{text}"
        );
        assert!(!text.contains(SECRET), "{text}");
        for h in ["h1", "h2"] {
            assert!(env.volumes(h).is_empty(), "{h}: {:?}", env.volumes(h));
            assert!(env.domains(h).is_empty(), "{h}: {:?}", env.domains(h));
        }
        assert_eq!(env.hits(), 0);

        // A listed key with a value the plugin's schema refuses: permanent, names the
        // field, and is refused before anything is downloaded or made.
        let env = Env::new();
        let p = provider_with_overridable_port(&env);
        let r = p
            .create(&request_overriding(
                &uid(0xd4),
                serde_json::json!({"listenPort": 70000}),
            ))
            .await;
        assert_eq!(class_of(&r), ErrorClass::Permanent, "{r:?}");
        let text = shown(&r.unwrap_err());
        assert!(
            text.contains("spec.templateSettings.vendorData.listenPort"),
            "{text}"
        );
        assert!(!text.contains(SECRET), "{text}");
        for h in ["h1", "h2"] {
            assert!(env.volumes(h).is_empty(), "{h}: {:?}", env.volumes(h));
            assert!(env.domains(h).is_empty(), "{h}: {:?}", env.domains(h));
        }
        assert_eq!(env.hits(), 0, "no image download for a refused Create");
    });
}

// Issue 12 (lifecycle under churn): define-time marks and a GC sweep racing a
// replacement, adoption of paused/suspended/blocked domains, leftover volumes, ownership.
mod lifecycle {
    use super::*;
    use egress_operator::gc::{
        FakeProxyIndex, GarbageCollector, GcMetrics, KeepReason, Owner, VolumeCollector,
        VolumeKeep, VolumeKind,
    };
    use egress_operator::instance::{image_heartbeat_name, image_takeover_name};
    use egress_operator::provider::kvm2::backend::StampClock;
    use egress_operator::provider::{NotOwned, SharedProvider};
    use std::sync::atomic::AtomicI64;

    /// The test's "now" at offset zero.
    fn t0() -> jiff::Timestamp {
        "2026-03-01T12:00:00Z".parse().unwrap()
    }

    /// A clock both the provider's mark stamp and the GC read: t0 plus an offset in
    /// seconds a test moves.
    #[derive(Clone, Default)]
    struct Clock(Arc<AtomicI64>);

    impl Clock {
        fn now(&self) -> jiff::Timestamp {
            t0() + jiff::SignedDuration::from_secs(self.0.load(Ordering::SeqCst))
        }
        fn advance(&self, secs: i64) {
            self.0.fetch_add(secs, Ordering::SeqCst);
        }
        fn stamp(&self) -> StampClock {
            let c = self.clone();
            StampClock::new(move || std::time::SystemTime::from(c.now()))
        }
    }

    fn clocked_provider(env: &Env, ops: Arc<dyn HostOps>, clock: &Clock) -> Kvm2Provider {
        let mut options = logic_options(HealthBoard::default());
        options.start_timeout = Duration::from_millis(500);
        options.clock = clock.stamp();
        fake_rig::provider_with(&env.config, ops, options)
    }

    fn gc_over(
        providers: Vec<SharedProvider>,
        index: Arc<FakeProxyIndex>,
        clock: &Clock,
        keep_unused: u32,
    ) -> GarbageCollector {
        let mut config = env_gc_config();
        config.retired_images.keep_unused = keep_unused;
        let c = clock.clone();
        GarbageCollector::new(providers, index, &config, GcMetrics::default())
            .with_clock(move || c.now())
    }

    /// Grace 600 s; retired images go after an hour unused.
    fn env_gc_config() -> egress_operator::config::GcConfig {
        let mut c = egress_operator::config::GcConfig {
            grace_period_seconds: 600,
            ..Default::default()
        };
        c.retired_images.unused_for_seconds = 3600;
        c
    }

    fn owner(name: &str, named: Option<InstanceId>, provisioning: bool) -> Owner {
        Owner {
            namespace: "default".into(),
            name: name.into(),
            instance_id: named,
            deleting: false,
            provisioning,
        }
    }

    fn id_on(host: &str, uid: &str) -> InstanceId {
        InstanceId {
            host: host.into(),
            name: dom(uid),
        }
    }

    /// Moves the clock when the image upload starts (a slow download), and can park the
    /// Create right before it starts its domain.
    struct Churn {
        clock: Clock,
        download_takes: i64,
        park_start: AtomicBool,
        parked: Notify,
        release: Notify,
    }

    impl OpHook for Churn {
        fn before<'a>(
            &'a self,
            op: &'static str,
            _host: &'a str,
            target: Option<&'a str>,
        ) -> BoxFuture<'a, Result<(), OpsError>> {
            Box::pin(async move {
                if op == "volume-upload" && target.is_some_and(|t| t.starts_with("egress-image-")) {
                    self.clock.advance(self.download_takes);
                }
                if op == "domain-start" && self.park_start.swap(false, Ordering::SeqCst) {
                    self.parked.notify_one();
                    self.release.notified().await;
                }
                Ok(())
            })
        }
    }

    fn churn(clock: &Clock, download_takes: i64, park_start: bool) -> Churn {
        Churn {
            clock: clock.clone(),
            download_takes,
            park_start: AtomicBool::new(park_start),
            parked: Notify::new(),
            release: Notify::new(),
        }
    }

    #[test]
    fn the_mark_is_stamped_when_the_domain_is_defined_not_before_the_download() {
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let ops = Arc::new(Hooked::wrap(env.ops(), churn(&clock, 7200, false)));
            let p = clocked_provider(&env, ops, &clock);
            let inst = p
                .create(&request(&uid(1), "web", Some("h2")))
                .await
                .unwrap();
            assert_eq!(
                inst.created_at, "2026-03-01T14:00:00Z",
                "after the 2 h download"
            );
            let got = p.get(&inst.id).await.unwrap();
            assert_eq!(got.created_at, "2026-03-01T14:00:00Z", "as the mark says");
        });
    }

    /// The Proxy ran on h1; its instance crashed and the controller replaces it on h2.
    /// The download took longer than the grace period, and a GC sweep runs while the
    /// replacement's domain is defined but not started, the status still naming h1.
    #[test]
    fn a_replacement_on_another_host_racing_a_sweep_is_never_collected() {
        let env = Env::new();
        run(async {
            let u = uid(2);
            let clock = Clock::default();
            let old = MetadataMark {
                created_at: "2026-02-01T00:00:00Z".into(),
                ..mark("test", "web", &u)
            };
            env.fake.put_domain(
                "h1",
                &dom(&u),
                &domain_xml(&dom(&u), Some(&old)),
                InstanceState::Crashed,
            );
            let ops = Arc::new(Hooked::wrap(env.ops(), churn(&clock, 7200, true)));
            let p = Arc::new(clocked_provider(&env, ops.clone(), &clock));
            let index = Arc::new(FakeProxyIndex::new());
            // The controller marked the Proxy provisioning ("Replacing") before the Create.
            index.insert(&u, owner("web", Some(id_on("h1", &u)), true));
            let gc = gc_over(vec![p.clone()], index.clone(), &clock, 1);

            let create = {
                let (p, req) = (p.clone(), request(&u, "web", Some("h2")));
                tokio::spawn(async move { p.create(&req).await })
            };
            ops.hook().parked.notified().await;
            clock.advance(60);
            assert_eq!(env.domains("h2"), names([dom(&u)]), "defined, not started");

            // A sweep must neither delete nor try to (a delete would wait on the
            // Create's name lock: the guard turns that into a failure, not a hang).
            let sweep = |what: &'static str| {
                let gc = &gc;
                async move {
                    tokio::time::timeout(Duration::from_secs(20), gc.sweep_once())
                        .await
                        .unwrap_or_else(|_| panic!("{what}: the sweep tried to delete"))
                }
            };
            let report = sweep("provisioning").await;
            assert_eq!(
                report.kept_reason(&id_on("h2", &u)),
                Some(&KeepReason::CreateInProgress)
            );
            // Even with a status that does not say so (its write failed), the grace
            // period counts from the define, not from before the download.
            index.insert(&u, owner("web", Some(id_on("h1", &u)), false));
            let report = sweep("running").await;
            assert!(matches!(
                report.kept_reason(&id_on("h2", &u)),
                Some(KeepReason::Young { age_seconds: 60 })
            ));
            assert!(report.deleted.is_empty(), "{:?}", report.deleted);

            ops.hook().release.notify_one();
            let inst = create.await.unwrap().unwrap();
            assert_eq!(inst.id, id_on("h2", &u));
            assert_eq!(
                env.fake.domain_state("h2", &dom(&u)),
                Some(InstanceState::Running)
            );
            // The controller names the replacement; later the old one on h1 goes, the
            // new one stays.
            index.insert(&u, owner("web", Some(id_on("h2", &u)), false));
            clock.advance(3600);
            let report = sweep("named").await;
            assert_eq!(report.deleted_ids(), vec![&id_on("h1", &u)]);
            assert_eq!(env.domains("h2"), names([dom(&u)]));
            assert!(env.domains("h1").is_empty());
        });
    }

    /// Our domain, created and then put in `state` behind our back, is Created again.
    async fn adopt_from(env: &Env, p: &Kvm2Provider, u: &str, state: InstanceState) {
        p.create(&request(u, "web", Some("h1"))).await.unwrap();
        env.fake.set_state("h1", &dom(u), state);
    }

    #[test]
    fn adoption_resumes_a_paused_domain_and_wakes_a_suspended_one() {
        let env = Env::new();
        run(async {
            let p = env.provider();
            for (n, state) in [(3, InstanceState::Paused), (4, InstanceState::Suspended)] {
                let u = uid(n);
                adopt_from(&env, &p, &u, state).await;
                let (defines, wakes) = (
                    env.fake.calls("domain-define"),
                    env.fake.calls("domain-wake"),
                );
                let inst = p.create(&request(&u, "web", Some("h1"))).await.unwrap();
                assert_eq!(inst.state, InstanceState::Running, "{state}");
                assert_eq!(env.fake.calls("domain-wake"), wakes + 1, "{state}");
                assert_eq!(env.fake.calls("domain-define"), defines, "{state}: adopted");
            }
        });
    }

    #[test]
    fn adoption_takes_a_blocked_domain_as_running() {
        let env = Env::new();
        run(async {
            let p = env.provider();
            let u = uid(5);
            adopt_from(&env, &p, &u, InstanceState::Blocked).await;
            let (starts, wakes) = (
                env.fake.calls("domain-start"),
                env.fake.calls("domain-wake"),
            );
            let inst = p.create(&request(&u, "web", Some("h1"))).await.unwrap();
            assert_eq!(inst.state, InstanceState::Blocked);
            assert_eq!(env.fake.calls("domain-start"), starts);
            assert_eq!(env.fake.calls("domain-wake"), wakes);
        });
    }

    #[test]
    fn adoption_replaces_a_domain_that_stays_paused() {
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let p = clocked_provider(&env, env.ops(), &clock);
            let u = uid(6);
            adopt_from(&env, &p, &u, InstanceState::Paused).await;
            // Paused again at once by every resume (an I/O error on its disk).
            env.fake.set_stuck("h1", &dom(&u));
            env.fake
                .put_volume("h1", &identity(&u).root_volume, b"disk that pauses it");
            let defines = env.fake.calls("domain-define");
            let inst = p.create(&request(&u, "web", Some("h1"))).await.unwrap();
            assert_eq!(inst.state, InstanceState::Running);
            assert_eq!(env.fake.calls("domain-define"), defines + 1, "defined anew");
            assert_eq!(env.volumes("h1"), env.expected(&[&u]));
            assert_ne!(
                env.fake.volume_data("h1", &identity(&u).root_volume),
                Some(b"disk that pauses it".to_vec()),
                "a fresh root volume"
            );
        });
    }

    /// A retired image's volume names (digest of `seed`), by role.
    fn retired(seed: &str) -> (String, String, String, String) {
        let sha = sha256_hex(seed.as_bytes());
        (
            image_volume_name(&sha),
            image_marker_name(&sha),
            image_takeover_name(&sha),
            image_heartbeat_name(&sha),
        )
    }

    #[test]
    fn leftover_volumes_are_collected_by_name_and_policy_and_nothing_else() {
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let p = Arc::new(clocked_provider(&env, env.ops(), &clock));
            let index = Arc::new(FakeProxyIndex::new());
            let gc = gc_over(vec![p.clone()], index.clone(), &clock, 1)
                .with_volumes(vec![p.clone() as Arc<dyn VolumeCollector>]);
            // A running instance of a configured image: untouched.
            let live = uid(7);
            p.create(&request(&live, "live", Some("h1"))).await.unwrap();
            index.insert(&live, owner("live", Some(id_on("h1", &live)), false));
            // Root and seed left by a Create whose Proxy is gone: collected.
            let gone = uid(8);
            for v in vm_volumes(&gone) {
                env.fake.put_volume("h1", &v, b"leftover");
            }
            // Root of a Proxy that exists and has no domain yet (Create under way): kept.
            let making = uid(9);
            env.fake
                .put_volume("h1", &identity(&making).root_volume, b"in the making");
            index.insert(&making, owner("making", None, true));
            // Volumes of a UID whose domain exists, even a foreign one: kept.
            let foreign = uid(10);
            env.fake.put_domain(
                "h1",
                &dom(&foreign),
                &domain_xml(&dom(&foreign), None),
                InstanceState::Running,
            );
            env.fake
                .put_volume("h1", &identity(&foreign).root_volume, b"theirs");
            // A retired image's staging leftovers (data without marker, claim, heartbeat).
            let (st_data, _, st_claim, st_beat) = retired("staging");
            for v in [&st_data, &st_claim, &st_beat] {
                env.fake.put_volume("h1", v, b"partial");
            }
            // Two unused retired bases; the policy keeps the most recently unused one.
            let (old_data, old_marker, _, _) = retired("old");
            env.fake.put_volume("h1", &old_data, b"old base");
            env.fake.put_volume("h1", &old_marker, b"");
            // A retired base an overlay still uses: kept.
            let (used_data, used_marker, _, _) = retired("used");
            env.fake.put_volume("h1", &used_data, b"used base");
            env.fake.put_volume("h1", &used_marker, b"");
            let pinned = uid(11);
            env.fake
                .put_overlay("h1", "default", &identity(&pinned).root_volume, &used_data);
            env.fake.put_domain(
                "h1",
                &dom(&pinned),
                &domain_xml(&dom(&pinned), Some(&mark("test", "pinned", &pinned))),
                InstanceState::Running,
            );
            index.insert(&pinned, owner("pinned", Some(id_on("h1", &pinned)), false));
            // Not exactly our names: never touched.
            for other in ["egress-notes", "vm1-root", "egress-web-root"] {
                env.fake.put_volume("h1", other, b"x");
            }
            let before = env.volumes("h1");

            let report = gc.sweep_once().await;
            assert!(report.volumes_deleted.is_empty(), "first sighting");
            assert_eq!(env.volumes("h1"), before);
            let kinds: std::collections::HashSet<(String, VolumeKind)> = report
                .volumes_kept
                .iter()
                .map(|(v, _)| (v.key.clone(), v.kind))
                .collect();
            let want: std::collections::HashSet<(String, VolumeKind)> = [
                (dom(&gone), VolumeKind::Instance),
                (dom(&making), VolumeKind::Instance),
                (st_data.clone(), VolumeKind::Staging),
                (old_data.clone(), VolumeKind::UnusedImage),
            ]
            .into_iter()
            .collect();
            assert_eq!(kinds, want);

            // Past the grace period the instance and staging leftovers go (the staging
            // one's heartbeat has not changed for the stale window); a newer retired
            // base turns unused, so the policy keeps that one and the older one goes once
            // it has been unused for its hour.
            tokio::time::sleep(STALE_AFTER).await;
            clock.advance(1800);
            let (new_data, new_marker, _, _) = retired("new");
            env.fake.put_volume("h1", &new_data, b"new base");
            env.fake.put_volume("h1", &new_marker, b"");
            let report = gc.sweep_once().await;
            let mut deleted: BTreeSet<String> = report
                .volumes_deleted
                .iter()
                .map(|v| v.key.clone())
                .collect();
            assert_eq!(deleted, names([dom(&gone), st_data.clone()]));
            clock.advance(1801);
            let report = gc.sweep_once().await;
            deleted.extend(report.volumes_deleted.iter().map(|v| v.key.clone()));
            assert_eq!(
                deleted,
                names([dom(&gone), st_data.clone(), old_data.clone()])
            );
            assert!(
                report
                    .volumes_kept
                    .iter()
                    .any(|(v, k)| v.key == dom(&making) && *k == VolumeKeep::ProxyExists)
            );
            assert!(
                report
                    .volumes_kept
                    .iter()
                    .any(|(v, k)| v.key == new_data && *k == VolumeKeep::Policy)
            );
            let mut left = before.clone();
            for v in vm_volumes(&gone)
                .into_iter()
                .chain([st_data, st_claim, st_beat, old_data, old_marker])
            {
                left.remove(&v);
            }
            left.extend([new_data, new_marker]);
            assert_eq!(env.volumes("h1"), left);
            assert!(report.deleted.is_empty(), "no instance collected");
            assert_eq!(env.domains("h1").len(), 3);
        });
    }

    /// Issue 19, finding 5: an upload of an image this cluster does not have (another
    /// cluster's, or a replica's with a newer config) that is slower than the grace is
    /// never collected while its heartbeat changes; once it stops, it goes.
    #[test]
    fn a_live_upload_is_never_collected_however_slow() {
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let p = Arc::new(clocked_provider(&env, env.ops(), &clock));
            let index = Arc::new(FakeProxyIndex::new());
            let gc = gc_over(vec![p.clone()], index.clone(), &clock, 0)
                .with_volumes(vec![p.clone() as Arc<dyn VolumeCollector>]);
            let (data, _, claim, beat) = retired("theirs, uploading");
            env.fake.put_volume("h1", &data, b"partial");
            env.fake.put_volume("h1", &claim, b"claim");
            let mut n = 0u32;
            let mut beat_now = |env: &Env| {
                n += 1;
                env.fake
                    .put_volume("h1", &beat, format!("beat {n}").as_bytes());
            };
            beat_now(&env);
            for _ in 0..6 {
                let report = gc.sweep_once().await;
                assert!(report.volumes_deleted.is_empty(), "{report:?}");
                assert!(env.volumes("h1").contains(&data));
                // Long past the grace on the GC's clock; the uploader beats meanwhile.
                clock.advance(900);
                tokio::time::sleep(STALE_AFTER / 2).await;
                beat_now(&env);
            }
            // The uploader died: its heartbeat stays as it is.
            let mut deleted = false;
            for _ in 0..4 {
                tokio::time::sleep(STALE_AFTER).await;
                clock.advance(900);
                let report = gc.sweep_once().await;
                deleted |= report.volumes_deleted.iter().any(|v| v.key == data);
            }
            assert!(deleted, "a dead upload's leftovers are collected");
            assert!(!env.volumes("h1").contains(&data));
        });
    }

    /// Issue 35, item 6: a host shared with another cluster (a domain carries its mark)
    /// no longer keeps every retired base. A base their overlay is backed by is kept (the
    /// backing-store check), as is one their fresh announcement lists (below); any other
    /// retired base is collected as on a host of our own.
    #[test]
    fn a_shared_host_keeps_only_the_bases_the_other_cluster_uses() {
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let p = Arc::new(clocked_provider(&env, env.ops(), &clock));
            let index = Arc::new(FakeProxyIndex::new());
            let gc = gc_over(vec![p.clone()], index.clone(), &clock, 0)
                .with_volumes(vec![p.clone() as Arc<dyn VolumeCollector>]);
            let (used, used_marker, _, _) = retired("their base");
            let (unused, unused_marker, _, _) = retired("nobody's base");
            for (data, marker) in [(&used, &used_marker), (&unused, &unused_marker)] {
                env.fake.put_volume("h1", data, b"base");
                env.fake.put_volume("h1", marker, b"");
            }
            let theirs = uid(0x40);
            env.fake.put_domain(
                "h1",
                &dom(&theirs),
                &domain_xml(&dom(&theirs), Some(&mark("other-cluster", "p", &theirs))),
                InstanceState::Running,
            );
            let overlay = format!("egress-{theirs}-root");
            env.fake.put_overlay("h1", "default", &overlay, &used);
            for _ in 0..3 {
                gc.sweep_once().await;
                clock.advance(7200);
            }
            let volumes = env.volumes("h1");
            assert!(volumes.contains(&used), "backs their overlay: kept");
            assert!(volumes.contains(&overlay), "their overlay: untouched");
            assert!(!volumes.contains(&unused), "used by nobody: collected");
            assert!(!volumes.contains(&unused_marker));
        });
    }

    /// Issue 35, item 5: two clusters that share hosts and a `clusterId` (a config
    /// copied from one to the other) tell their VMs apart by the cluster UID in the mark.
    /// Neither collects the other's VMs, though each one's index knows none of the
    /// other's Proxies; the host they share is not collected at all (nor our own orphan
    /// there) and each says so, in the sweep's report, an event and a gauge; a host only
    /// one of them uses is collected as usual.
    #[test]
    fn twins_under_one_cluster_id_collect_nothing_of_each_other() {
        use egress_operator::gc::events::GcEvents;
        const UID_A: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";
        const UID_B: &str = "7f00aa01-0000-4000-8000-000000000001";

        /// Hosts refused, with why.
        type Refusals = Vec<(String, String)>;
        #[derive(Default)]
        struct Recorded(std::sync::Mutex<Vec<(String, Refusals)>>);
        impl GcEvents for Recorded {
            fn refused<'a>(
                &'a self,
                provider: &'a str,
                hosts: &'a [(String, String)],
            ) -> futures_util::future::BoxFuture<'a, ()> {
                self.0
                    .lock()
                    .unwrap()
                    .push((provider.to_string(), hosts.to_vec()));
                Box::pin(async {})
            }
        }

        let env = Env::new();
        run(async {
            let clock = Clock::default();
            // Two parses of one config: two clusters, each with its own UID.
            let a_config = env.config.clone();
            let b_config = test_config(&env.http.url("/img"), &env.sha, 32);
            a_config.identity().resolve_in_cluster(UID_A).unwrap();
            b_config.identity().resolve_in_cluster(UID_B).unwrap();
            assert_eq!(a_config.identity().get().unwrap().id, "test");
            assert_eq!(b_config.identity().get().unwrap().id, "test");
            let clocked = |config: &Arc<ValidConfig>| {
                let mut options = logic_options(HealthBoard::default());
                options.clock = clock.stamp();
                Arc::new(fake_rig::provider_with(config, env.ops(), options))
            };
            let (a, b) = (clocked(&a_config), clocked(&b_config));
            let (ua, ua_orphan, ua2, ub) = (uid(0x51), uid(0x52), uid(0x53), uid(0x54));
            a.create(&request(&ua, "a", Some("h1"))).await.unwrap();
            a.create(&request(&ua_orphan, "a-gone", Some("h1")))
                .await
                .unwrap();
            a.create(&request(&ua2, "a-gone-2", Some("h2")))
                .await
                .unwrap();
            b.create(&request(&ub, "b", Some("h1"))).await.unwrap();
            let listed = env.ops().list_domains("h1").await.unwrap();
            let mark_of = |u: &str| {
                listed
                    .iter()
                    .find(|d| d.name == dom(u))
                    .and_then(|d| d.mark.clone())
                    .expect("marked")
            };
            assert_eq!(mark_of(&ua).cluster_uid.as_deref(), Some(UID_A));
            assert_eq!(mark_of(&ub).cluster_uid.as_deref(), Some(UID_B));

            // Each index knows its own live Proxy only.
            let a_index = Arc::new(FakeProxyIndex::new());
            a_index.insert(&ua, owner("a", Some(id_on("h1", &ua)), false));
            let b_index = Arc::new(FakeProxyIndex::new());
            b_index.insert(&ub, owner("b", Some(id_on("h1", &ub)), false));
            let events = Arc::new(Recorded::default());
            let a_gc = gc_over(vec![a.clone()], a_index, &clock, 0)
                .with_volumes(vec![a.clone() as Arc<dyn VolumeCollector>])
                .with_events(events.clone());
            let b_gc = gc_over(vec![b.clone()], b_index, &clock, 0)
                .with_volumes(vec![b.clone() as Arc<dyn VolumeCollector>]);
            let mut reports = Vec::new();
            for _ in 0..3 {
                clock.advance(7200);
                reports.push(a_gc.sweep_once().await);
                b_gc.sweep_once().await;
            }
            for u in [&ua, &ua_orphan, &ub] {
                assert!(
                    env.fake.domains("h1").contains(&dom(u)),
                    "{u} on the shared host: kept"
                );
            }
            assert!(
                !env.fake.domains("h2").contains(&dom(&ua2)),
                "a's orphan on a host no twin shares: collected"
            );
            let last = reports.last().unwrap();
            let skipped: Vec<_> = last
                .skipped_targets
                .iter()
                .map(|s| (s.target.as_str(), s.class))
                .collect();
            assert_eq!(skipped, vec![("h1", ErrorClass::Permanent)], "{last:?}");
            let message = &last.skipped_targets[0].message;
            assert!(
                message.contains("two clusters share a clusterId") && message.contains(UID_B),
                "{message}"
            );
            assert!(
                last.volume_targets_skipped.iter().any(|s| s.target == "h1"),
                "the volumes of the shared host are not collected either: {last:?}"
            );
            assert_eq!(a.sharing().twins("h1"), 1);
            assert_eq!(a.sharing().twins("h2"), 0);
            assert_eq!(b.sharing().twins("h1"), 2, "b sees both of a's domains");
            let raised = events.0.lock().unwrap().clone();
            assert_eq!(raised.len(), 3, "one event per sweep: {raised:?}");
            assert!(
                raised
                    .iter()
                    .all(|(p, hosts)| p == "kvm2" && hosts.len() == 1 && hosts[0].0 == "h1"),
                "{raised:?}"
            );
            // Neither can delete the other's VM by id, either.
            let err = a.delete(&id_on("h1", &ub)).await.unwrap_err();
            assert!(env.fake.domains("h1").contains(&dom(&ub)), "{err}");
        });
    }

    /// Issue 35, item 5: with no `clusterId` configured and the cluster UID not read yet,
    /// the provider knows no domain as its own. It creates nothing (no mark could be
    /// written) and its listing fails rather than read as empty, so a collector skips
    /// every host. Once the UID is known, the derived `clusterId` is marked.
    #[test]
    fn an_unknown_identity_creates_nothing_and_never_lists_as_empty() {
        const UID: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";
        let env = Env::new();
        run(async {
            let yaml = FakeConfig::new(&env.http.url("/img"), &env.sha)
                .host("h1", "")
                .host("h2", "")
                .yaml();
            assert!(yaml.contains("clusterId: test\n"), "{yaml}");
            let yaml = yaml.replacen("clusterId: test\n", "", 1);
            let config =
                Arc::new(config::parse(&yaml, "no-cluster-id", std::path::Path::new("/")).unwrap());
            let p = provider(&config, env.ops());
            let u = uid(0x61);
            let err = p.create(&request(&u, "x", Some("h1"))).await.unwrap_err();
            assert_eq!(err.class(), ErrorClass::Permanent, "{err}");
            assert!(
                err.to_string().contains("the cluster identity is unknown"),
                "{err}"
            );
            assert!(env.fake.domains("h1").is_empty());
            for listing in p.list().await {
                assert!(
                    listing.result.is_err(),
                    "{}: {:?}",
                    listing.target,
                    listing.result
                );
            }
            config.identity().resolve_in_cluster(UID).unwrap();
            p.create(&request(&u, "x", Some("h1"))).await.unwrap();
            let mark = env
                .ops()
                .list_domains("h1")
                .await
                .unwrap()
                .into_iter()
                .find_map(|d| d.mark)
                .expect("marked");
            assert_eq!(mark.cluster_id, "k8s-0b7c3c1e9a43");
            assert_eq!(mark.cluster_uid.as_deref(), Some(UID));
            assert!(p.list().await.iter().all(|l| l.result.is_ok()));
        });
    }

    /// Issue 19, finding 5: a host shared with another cluster that has no domain there
    /// yet. What it announced it uses (its Creates write the announcement once the base is
    /// sure) is kept while the announcement is fresh; once it has not changed for the
    /// stale window, the retired base goes; once unchanged for six windows, the
    /// announcement goes too.
    #[test]
    fn retired_images_another_cluster_announced_are_kept_while_it_is_fresh() {
        use egress_operator::cluster_identity::Resolved;
        use egress_operator::provider::kvm2::image::uses::{COLLECT_AFTER_WINDOWS, ImageUses};
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let p = Arc::new(clocked_provider(&env, env.ops(), &clock));
            let index = Arc::new(FakeProxyIndex::new());
            let gc = gc_over(vec![p.clone()], index.clone(), &clock, 0)
                .with_volumes(vec![p.clone() as Arc<dyn VolumeCollector>]);
            let sha = sha256_hex(b"their base");
            let (data, marker, _, _) = retired("their base");
            for host in ["h1", "h2"] {
                env.fake.put_volume(host, &data, b"base");
                env.fake.put_volume(host, &marker, b"");
            }
            // The other cluster, on h1 only, as its Create would after making sure of it.
            let other = Resolved {
                id: "other-cluster".into(),
                uid: Some("7f00aa01-0000-4000-8000-000000000001".into()),
            };
            let theirs = ImageUses::new(
                vec![egress_operator::instance::image_digest(&sha)],
                STALE_AFTER,
            );
            theirs
                .announce(&other, env.ops().as_ref(), "h1", "default")
                .await
                .unwrap();
            let announcement = egress_operator::provider::kvm2::image::uses::name_of(&other);
            for _ in 0..3 {
                gc.sweep_once().await;
                clock.advance(7200);
            }
            assert!(env.volumes("h1").contains(&data), "announced: kept");
            assert!(!env.volumes("h2").contains(&data), "ours alone: collected");
            assert_eq!(
                p.sharing().kept_shared("h1"),
                1,
                "kept for the other cluster"
            );
            assert_eq!(p.sharing().kept_shared("h2"), 0);

            // Their announcement goes stale: no Create of theirs made sure of it since.
            tokio::time::sleep(STALE_AFTER * 2).await;
            for _ in 0..3 {
                gc.sweep_once().await;
                clock.advance(7200);
            }
            assert!(!env.volumes("h1").contains(&data), "stale: collected");
            assert!(
                env.volumes("h1").contains(&announcement),
                "a stale announcement stays until its cluster has been gone for {COLLECT_AFTER_WINDOWS} windows"
            );
            assert_eq!(
                p.sharing().kept_shared("h1"),
                0,
                "nothing is kept for the other cluster any more"
            );

            // Unchanged for six windows: that cluster left the host; its record goes.
            tokio::time::sleep(STALE_AFTER * COLLECT_AFTER_WINDOWS).await;
            for _ in 0..2 {
                gc.sweep_once().await;
                clock.advance(7200);
            }
            assert!(
                !env.volumes("h1").contains(&announcement),
                "an abandoned announcement is collected"
            );
        });
    }

    /// Our own Create announces the images our config has on the host it made sure of,
    /// in a record another cluster reads.
    #[test]
    fn a_create_announces_the_images_this_cluster_uses_on_its_host() {
        use egress_operator::provider::kvm2::image::uses::listed;
        let env = Env::new();
        run(async {
            let p = env.provider();
            let u = uid(0x41);
            p.create(&request(&u, "web", Some("h1"))).await.unwrap();
            let name = egress_operator::instance::image_use_name("test", None);
            let record = env.fake.volume_data("h1", &name).expect("announced");
            let digests = listed(&record).expect("a whole record");
            assert_eq!(
                digests,
                [egress_operator::instance::image_digest(&env.sha)]
                    .into_iter()
                    .collect::<BTreeSet<_>>()
            );
            assert!(
                env.fake.volume_data("h2", &name).is_none(),
                "only where it made sure"
            );
        });
    }

    /// Fails every domain listing of one host while armed; volume listings still answer.
    struct NoDomainList {
        host: &'static str,
        armed: AtomicBool,
    }

    impl OpHook for NoDomainList {
        fn before<'a>(
            &'a self,
            op: &'static str,
            host: &'a str,
            _target: Option<&'a str>,
        ) -> BoxFuture<'a, Result<(), OpsError>> {
            let fail =
                op == "domain-list" && host == self.host && self.armed.load(Ordering::SeqCst);
            Box::pin(std::future::ready(if fail {
                Err(OpsError::Injected {
                    op,
                    host: host.into(),
                    class: ErrorClass::Transient,
                })
            } else {
                Ok(())
            }))
        }
    }

    /// A host whose domains cannot be listed has its volumes judged by nothing: were the
    /// failed listing read as "no domains", a running instance's disks would look left
    /// over.
    #[test]
    fn no_leftover_is_collected_on_a_host_whose_listing_failed() {
        let env = Env::new();
        run(async {
            let clock = Clock::default();
            let ops = Arc::new(Hooked::wrap(
                env.ops(),
                NoDomainList {
                    host: "h2",
                    armed: AtomicBool::new(false),
                },
            ));
            let p = Arc::new(clocked_provider(&env, ops.clone(), &clock));
            let index = Arc::new(FakeProxyIndex::new());
            let gc = gc_over(vec![p.clone()], index.clone(), &clock, 0)
                .with_volumes(vec![p.clone() as Arc<dyn VolumeCollector>]);
            // A running instance on h2 with no Proxy (its finalizer has yet to run): only
            // its domain says its volumes are in use.
            let live = uid(16);
            p.create(&request(&live, "live", Some("h2"))).await.unwrap();
            let gone = uid(12);
            for host in ["h1", "h2"] {
                for v in vm_volumes(&gone) {
                    env.fake.put_volume(host, &v, b"leftover");
                }
            }
            let h2_before = env.volumes("h2");
            ops.hook().armed.store(true, Ordering::SeqCst);
            gc.sweep_once().await;
            clock.advance(3600);
            let report = gc.sweep_once().await;
            assert_eq!(report.volume_targets_skipped.len(), 1);
            assert_eq!(report.volume_targets_skipped[0].target, "h2");
            assert!(env.volumes("h1").is_empty(), "{:?}", env.volumes("h1"));
            assert_eq!(env.volumes("h2"), h2_before);
            assert_eq!(env.domains("h2"), names([dom(&live)]));
        });
    }

    #[test]
    fn get_and_delete_for_another_proxy_are_refused_and_touch_nothing() {
        let env = Env::new();
        run(async {
            let p = env.provider();
            let (mine, theirs) = (uid(13), uid(14));
            let inst = p
                .create(&request(&theirs, "theirs", Some("h1")))
                .await
                .unwrap();
            let before = (env.domains("h1"), env.volumes("h1"));
            let (destroys, deletes) = (
                env.fake.calls("domain-destroy"),
                env.fake.calls("volume-delete"),
            );
            // A Proxy whose status names someone else's instance (restored, hand-edited).
            let e = p.get_owned(&inst.id, &mine).await.unwrap_err();
            assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
            assert!(e.inner().downcast_ref::<NotOwned>().is_some(), "{e}");
            let e = p.delete_owned(&inst.id, &mine).await.unwrap_err();
            assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
            assert_eq!((env.domains("h1"), env.volumes("h1")), before);
            assert_eq!(env.fake.calls("domain-destroy"), destroys);
            assert_eq!(env.fake.calls("volume-delete"), deletes);
            // Its owner still can.
            assert_eq!(p.get_owned(&inst.id, &theirs).await.unwrap().id, inst.id);
            p.delete_owned(&inst.id, &theirs).await.unwrap();
            assert!(env.domains("h1").is_empty());
        });
    }

    #[test]
    fn an_instance_on_a_host_removed_from_the_config_is_refused_not_lost() {
        let env = Env::with(Opts {
            fake_hosts: &["h1", "h2", "h3"],
            ..Opts::default()
        });
        run(async {
            let p = env.provider();
            let u = uid(15);
            let xml = domain_xml(&dom(&u), Some(&mark("test", "web", &u)));
            env.fake
                .put_domain("h3", &dom(&u), &xml, InstanceState::Running);
            let id = id_on("h3", &u);
            for r in [
                p.get(&id).await.map(drop),
                p.delete(&id).await,
                p.delete_owned(&id, &u).await,
            ] {
                let e = r.unwrap_err();
                assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
                assert!(shown(&e).contains("not in the providers config"), "{e}");
            }
            assert_eq!(env.domains("h3"), names([dom(&u)]));
        });
    }
}
