//! The kvm2 provider's base image cache and its listing, on real components: OpenSSH's
//! sshd, an isolated libvirtd with QEMU in a network namespace reached only through our
//! SSH tunnel, and images served by a loopback HTTP server that misbehaves on purpose.
//!
//! Every failed download must leave the pool exactly as it was (invariant 4: a
//! half-written or unverified volume is never kept), racing replicas must download once,
//! a dead uploader's leftover must be taken over, and a listing must never turn a host
//! that could not be reached into an empty success (invariant 6).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egress_operator::Classified as _;
use egress_operator::config::{ProvidersConfig, ValidConfig};
use egress_operator::error::ErrorClass;
use egress_operator::instance::{InstanceIdentity, image_marker_name, image_volume_name};
use egress_operator::provider::kvm2::backend::{Kvm2Options, Kvm2Provider};
use egress_operator::provider::kvm2::fetch::FetchPolicy;
use egress_operator::provider::kvm2::hosts::Hosts;
use egress_operator::provider::kvm2::image::{ImageCacheOptions, ImageMetrics, UploadProgress};
use egress_operator::provider::kvm2::libvirt::BlockingPool;
use egress_operator::provider::kvm2::observe::CallMetrics;
use egress_operator::provider::kvm2::ops::{HostOps, LibvirtOps};
use egress_operator::provider::{CreateRequest, InstanceState, Provider, ProviderError};
use egress_operator::templates::{TemplateEngine, TemplateSet};
use integration_tests::http::{HttpServer, Route};
use integration_tests::provider_rig::{Rig, request, run, uid};
use integration_tests::{TestImage, provider_config, sha256_hex};

/// How long the rig's cache waits before taking over a staging volume whose heartbeat
/// stopped (the same as [`Rig::provider`]).
const STALE_AFTER: Duration = Duration::from_secs(3);

/// The cache options of [`Rig::provider`]: a stale staging volume is taken over quickly.
fn cache_options() -> ImageCacheOptions {
    ImageCacheOptions {
        stale_after: STALE_AFTER,
        poll_every: Duration::from_millis(200),
        ..ImageCacheOptions::default()
    }
}

/// A provider like [`Rig::provider`], but over any config and with these cache options.
fn provider_with(
    config: &Arc<ValidConfig>,
    ops: Arc<dyn HostOps>,
    images: ImageCacheOptions,
) -> Kvm2Provider {
    let engine = TemplateEngine::new(None).unwrap();
    let templates = Arc::new(TemplateSet::load(&engine, &config.kvm2.templates));
    assert!(templates.is_healthy(), "{:?}", templates.health());
    let options = Kvm2Options {
        images,
        start_timeout: Duration::from_secs(60),
        shutdown_timeout: Duration::from_secs(2),
        ..Kvm2Options::default()
    };
    Kvm2Provider::new(
        config.clone(),
        ops,
        templates,
        options,
        ImageMetrics::default(),
    )
}

/// A hosts table of its own over `config`: a separate SSH connection per host, as a
/// second operator replica (or a second process) would have.
fn hosts_for(config: &ValidConfig) -> Arc<Hosts> {
    Arc::new(
        Hosts::new(
            &config.kvm2.ssh,
            &config.kvm2.hosts,
            BlockingPool::default(),
            Arc::new(CallMetrics::unregistered()),
        )
        .unwrap(),
    )
}

/// An image entry served by `http` at `path`.
fn image(http: &HttpServer, name: &str, path: &str, sha256: &str) -> TestImage {
    TestImage {
        name: name.into(),
        url: http.url(path),
        sha256: sha256.into(),
        max_size_mib: None,
    }
}

/// A Create like [`request`], asking for image `image`.
fn request_image(n: u8, name: &str, image: &str) -> CreateRequest {
    let mut req = request(&uid(n), name);
    req.spec.image = Some(image.into());
    req
}

/// A Create that must fail: its error.
async fn create_fails(p: &Kvm2Provider, req: &CreateRequest) -> ProviderError {
    match p.create(req).await {
        Ok(inst) => panic!("the Create succeeded: {:?}", inst.id),
        Err(e) => e,
    }
}

/// After a failed Create: no volume of any kind and no domain.
fn assert_nothing_left(rig: &Rig, what: &str) {
    assert!(
        rig.volumes().is_empty(),
        "{what}: leaked volumes {:?}",
        rig.volumes()
    );
    assert!(
        rig.domains().is_empty(),
        "{what}: leaked domains {:?}",
        rig.domains()
    );
}

/// A volume's capacity in bytes, from `virsh vol-info --bytes`.
fn capacity(rig: &Rig, name: &str) -> u64 {
    let info = rig.virsh(&["vol-info", name, "--pool", "default", "--bytes"]);
    info.lines()
        .find_map(|l| l.strip_prefix("Capacity:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no capacity in {info:?}"))
}

/// The rig's config with `allowPrivateAddresses` off on every image: the production
/// policy, with only the test server's own address exempted by the fetch policy.
fn strict_config(config: &ValidConfig) -> Arc<ValidConfig> {
    let mut raw: ProvidersConfig = (**config).clone();
    for i in &mut raw.kvm2.images {
        i.allow_private_addresses = false;
    }
    let yaml = serde_yaml_ng::to_string(&raw).unwrap();
    Arc::new(
        egress_operator::config::parse(&yaml, "strict-config", std::path::Path::new("/")).unwrap(),
    )
}

// ---------------------------------------------------------------------------------------
// Downloads that must not leave anything behind

#[test]
fn sha256_mismatch_is_permanent_and_leaves_no_volume() {
    let wrong = "ab".repeat(32);
    let Some(rig) = Rig::start(vec![], |http, _| {
        vec![image(http, "base", "/base.qcow2", &wrong)]
    }) else {
        return;
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let req = request(&uid(1), "mismatch");
        let e = create_fails(&p, &req).await;
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        let msg = e.to_string();
        assert!(msg.contains("sha256 of"), "{msg}");
        assert!(msg.contains(&format!("expected {wrong}")), "{msg}");
        assert!(msg.contains(&rig.image_sha), "the actual digest: {msg}");
        assert_eq!(rig.http.hits("/base.qcow2"), 1, "it was downloaded");
        assert_eq!(
            p.image_cache().metrics().uploads("h1", "base", "permanent"),
            1
        );
        // The alert on verification failures reads this counter.
        assert_eq!(
            p.image_cache()
                .metrics()
                .verification_failures("h1", "base"),
            1
        );
        assert_nothing_left(&rig, "after the mismatch");

        // Nothing unverified was kept: a second Create downloads again, fails again.
        let e = create_fails(&p, &req).await;
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        assert_eq!(rig.http.hits("/base.qcow2"), 2);
        assert_nothing_left(&rig, "after the second mismatch");
        rig.hosts.close().await;
    });
}

#[test]
fn truncated_download_is_transient_and_leaves_no_volume() {
    let body: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
    let sha = sha256_hex(&body);
    let route = Route::Truncated {
        body: Arc::new(body),
        declared: 1024 * 1024,
    };
    let Some(rig) = Rig::start(vec![("/short.qcow2".into(), route)], |http, _| {
        vec![image(http, "short", "/short.qcow2", &sha)]
    }) else {
        return;
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let e = create_fails(&p, &request(&uid(2), "truncated")).await;
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        let msg = e.to_string();
        assert!(msg.contains("ended after"), "{msg}");
        assert!(msg.contains("of 1048576"), "{msg}");
        assert_eq!(rig.http.hits("/short.qcow2"), 1);
        assert_eq!(
            p.image_cache()
                .metrics()
                .uploads("h1", "short", "transient"),
            1
        );
        // A transfer that broke off is not a verification failure: a retry may succeed.
        assert_eq!(
            p.image_cache()
                .metrics()
                .verification_failures("h1", "short"),
            0
        );
        assert_nothing_left(&rig, "after the truncated download");
        rig.hosts.close().await;
    });
}

#[test]
fn image_over_its_size_cap_is_permanent_and_leaves_no_volume() {
    let dir = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..2 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(31) % 253) as u8)
        .collect();
    let sha = sha256_hex(&big);
    let path = dir.path().join("big.qcow2");
    std::fs::write(&path, &big).unwrap();
    let Some(rig) = Rig::start(vec![("/big.qcow2".into(), Route::File(path))], |http, _| {
        vec![TestImage {
            max_size_mib: Some(1),
            ..image(http, "big", "/big.qcow2", &sha)
        }]
    }) else {
        return;
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let e = create_fails(&p, &request(&uid(3), "oversize")).await;
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("larger than the limit of 1048576 bytes"),
            "{msg}"
        );
        assert!(msg.contains("Content-Length is 2097152"), "{msg}");
        assert_nothing_left(&rig, "after the oversize image");
        rig.hosts.close().await;
    });
}

/// Redirects to addresses the policy refuses fail before any connection: with
/// `allowPrivateAddresses` (the test config), only the always-refused ranges (cloud
/// metadata in any spelling, unspecified); with the production policy (only the test
/// server's address exempted), private and other loopback addresses too. `0.0.0.0:PORT`
/// and `127.0.0.2:PORT` would reach a real server here (`target`), so its hit count
/// proves no connection was made; the others are never reachable from this machine, so
/// an immediate `refused` error (not a connect failure or timeout) is the proof.
#[test]
fn redirects_to_refused_addresses_are_permanent_and_never_connect() {
    let dir = tempfile::tempdir().unwrap();
    let (path, target_sha) = integration_tests::small_qcow2(dir.path(), "target").unwrap();
    let target = HttpServer::start(vec![("/t.qcow2".into(), Route::File(path))]).unwrap();
    let port = target
        .url("")
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<u16>()
        .unwrap();
    let redirects = [
        ("metadata", "http://169.254.169.254/latest".to_string()),
        (
            "mapped",
            "http://[::ffff:169.254.169.254]/latest".to_string(),
        ),
        ("decimal", "http://2852039166/latest".to_string()),
        ("alibaba", "http://100.100.100.200/latest".to_string()),
        ("unspec", format!("http://0.0.0.0:{port}/t.qcow2")),
        ("private", "http://10.0.0.1/x".to_string()),
        ("loop", format!("http://127.0.0.2:{port}/t.qcow2")),
    ];
    let routes = redirects
        .iter()
        .map(|(name, to)| (format!("/to-{name}"), Route::Redirect(to.clone())))
        .collect();
    let Some(rig) = Rig::start(routes, |http, _| {
        redirects
            .iter()
            .map(|(name, _)| image(http, name, &format!("/to-{name}"), &target_sha))
            .collect()
    }) else {
        return;
    };
    run(async {
        // Refused even with allowPrivateAddresses: checked on the rig's own config.
        let lax = rig.provider(rig.ops.clone());
        for (n, (name, why)) in [
            ("metadata", "cloud metadata"),
            ("mapped", "cloud metadata"),
            ("decimal", "cloud metadata"),
            ("alibaba", "cloud metadata"),
            ("unspec", "unspecified"),
        ]
        .into_iter()
        .enumerate()
        {
            let started = Instant::now();
            let req = request_image(40 + n as u8, "redirected", name);
            let e = create_fails(&lax, &req).await;
            assert_eq!(e.class(), ErrorClass::Permanent, "{name}: {e}");
            let msg = e.to_string();
            assert!(msg.contains("redirect hop 1 to"), "{name}: {msg}");
            assert!(msg.contains(why), "{name}: {msg}");
            assert!(
                msg.contains("refused even with allowPrivateAddresses"),
                "{name}: {msg}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{name}: refused at once, not after a connect attempt: {:?}",
                started.elapsed()
            );
            assert_eq!(rig.http.hits(&format!("/to-{name}")), 1, "{name}");
            assert_nothing_left(&rig, name);
        }

        // The production policy: the test server's address exempted, nothing else.
        let strict = strict_config(&rig.config);
        let options = ImageCacheOptions {
            fetch: FetchPolicy {
                exempt_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
                ..FetchPolicy::default()
            },
            ..cache_options()
        };
        let p = provider_with(&strict, rig.ops.clone(), options);
        for (n, (name, why)) in [
            ("private", "10.0.0.1 is in the private"),
            ("loop", "127.0.0.2 is in the loopback"),
            ("metadata", "cloud metadata"),
        ]
        .into_iter()
        .enumerate()
        {
            let started = Instant::now();
            let req = request_image(50 + n as u8, "redirected", name);
            let e = create_fails(&p, &req).await;
            assert_eq!(e.class(), ErrorClass::Permanent, "{name}: {e}");
            let msg = e.to_string();
            assert!(msg.contains("redirect hop 1 to"), "{name}: {msg}");
            assert!(msg.contains(why), "{name}: {msg}");
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{name}: {:?}",
                started.elapsed()
            );
            assert_nothing_left(&rig, name);
        }
        assert_eq!(
            target.hits("/t.qcow2"),
            0,
            "no refused hop reached the server behind it"
        );
        rig.hosts.close().await;
    });
}

// ---------------------------------------------------------------------------------------
// Racing and crashed uploaders

/// Two replicas (two providers, two hosts tables, two SSH connections; no lock shared in
/// process) Create different proxies with the same image at once: they meet at the
/// exclusive create of the data volume, one uploads, the other waits for the marker.
/// Both domains run and are deleted again. Returns how often the image was requested.
async fn race_two_replicas(rig: &Rig) -> usize {
    let a = rig.provider(rig.ops.clone());
    let hosts_b = hosts_for(&rig.config);
    let b = provider_with(
        &rig.config,
        Arc::new(LibvirtOps::new(hosts_b.clone())),
        cache_options(),
    );
    // Both links up first, so that the two Creates reach the image cache in step.
    for l in a.list().await.into_iter().chain(b.list().await) {
        assert!(l.result.unwrap().is_empty());
    }
    let (ra, rb) = (
        request(&uid(60), "replica-a"),
        request(&uid(61), "replica-b"),
    );
    let (ia, ib) = tokio::join!(a.create(&ra), b.create(&rb));
    let (ia, ib) = (ia.unwrap(), ib.unwrap());
    assert_eq!(ia.state, InstanceState::Running);
    assert_eq!(ib.state, InstanceState::Running);
    let ok = |p: &Kvm2Provider| p.image_cache().metrics().uploads("h1", "base", "ok");
    assert_eq!(ok(&a) + ok(&b), 1, "one upload between the replicas");
    let mut domains = rig.domains();
    domains.sort();
    let mut expected = vec![ia.id.name.clone(), ib.id.name.clone()];
    expected.sort();
    assert_eq!(domains, expected);
    for d in &expected {
        assert_eq!(rig.virsh(&["domstate", d]).trim(), "running", "{d}");
    }
    let hits = rig.http.hits("/base.qcow2");
    a.delete(&ia.id).await.unwrap();
    b.delete(&ib.id).await.unwrap();
    assert!(rig.domains().is_empty(), "{:?}", rig.domains());
    let mut base = rig.base_volumes();
    base.sort();
    assert_eq!(rig.volumes(), base, "only the committed image is left");
    rig.hosts.close().await;
    hosts_b.close().await;
    hits
}

#[test]
fn two_replicas_racing_upload_the_image_once_and_both_run() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let hits = run(race_two_replicas(&rig));
    assert!(
        (1..=2).contains(&hits),
        "at most one request per replica: {hits}"
    );
}

#[test]
fn two_replicas_racing_download_the_image_once() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let hits = run(race_two_replicas(&rig));
    assert_eq!(hits, 1, "one download for two replicas");
}

/// A data volume without its marker and without a heartbeat that changes is a crashed
/// uploader's: after `stale_after` the Create deletes it, uploads and verifies the image,
/// and commits it.
#[test]
fn a_crashed_uploaders_leftover_is_taken_over_after_the_stale_window() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let data = image_volume_name(&rig.image_sha);
    let marker = image_marker_name(&rig.image_sha);
    rig.virsh(&["vol-create-as", "default", &data, "1M", "--format", "raw"]);
    assert_eq!(rig.volumes(), vec![data.clone()]);
    assert_eq!(capacity(&rig, &data), 1024 * 1024);
    assert!(!rig.pool_dir.join(&marker).exists());
    let size = std::fs::metadata(rig.images_dir.path().join("base.qcow2"))
        .unwrap()
        .len();
    run(async {
        let p = rig.provider(rig.ops.clone());
        let started = Instant::now();
        let inst = p.create(&request(&uid(70), "after-crash")).await.unwrap();
        assert!(
            started.elapsed() >= STALE_AFTER,
            "took over only after the stale window: {:?}",
            started.elapsed()
        );
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(rig.http.hits("/base.qcow2"), 1);
        assert_eq!(p.image_cache().metrics().uploads("h1", "base", "ok"), 1);
        let id = InstanceIdentity::for_uid(&uid(70)).unwrap();
        let mut expected = vec![
            data.clone(),
            marker.clone(),
            egress_operator::instance::image_use_name("test", None),
            id.root_volume.clone(),
            id.seed_volume.clone(),
        ];
        expected.sort();
        assert_eq!(rig.volumes(), expected, "committed, and nothing else left");
        // The leftover's 1 MiB of zeros was replaced by the verified image itself.
        let content = std::fs::read(rig.pool_dir.join(&data)).unwrap();
        assert_eq!(content.len() as u64, size);
        assert_eq!(sha256_hex(&content), rig.image_sha);
        assert_eq!(rig.domains(), vec![id.domain_name]);
        p.delete(&inst.id).await.unwrap();
        assert!(rig.domains().is_empty());
        rig.hosts.close().await;
    });
}

/// A marker without its data volume (someone deleted the data by hand) is not a cache
/// hit: the marker is removed and the image downloaded, verified and committed again.
#[test]
fn a_marker_without_its_data_volume_is_cached_again() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let marker = image_marker_name(&rig.image_sha);
    rig.virsh(&["vol-create-as", "default", &marker, "0", "--format", "raw"]);
    assert_eq!(rig.volumes(), vec![marker.clone()]);
    run(async {
        let p = rig.provider(rig.ops.clone());
        let inst = p.create(&request(&uid(75), "orphan")).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(rig.http.hits("/base.qcow2"), 1);
        assert_eq!(p.image_cache().metrics().uploads("h1", "base", "ok"), 1);
        let data = image_volume_name(&rig.image_sha);
        let content = std::fs::read(rig.pool_dir.join(&data)).unwrap();
        assert_eq!(sha256_hex(&content), rig.image_sha);
        p.delete(&inst.id).await.unwrap();
        let mut base = rig.base_volumes();
        base.sort();
        assert_eq!(rig.volumes(), base);
        rig.hosts.close().await;
    });
}

// ---------------------------------------------------------------------------------------
// Listing and progress

/// GC's view with one host down: the live host lists our domain, the dead one is an
/// error (never an empty success that GC could read as "nothing there").
#[test]
fn listing_with_a_dead_host_reports_it_as_an_error_not_as_empty() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dead = format!("127.0.0.1:{closed}");
    let config = Arc::new(
        provider_config(
            &rig.sshd,
            &rig.libvirtd,
            "h1",
            &Rig::base_image(&rig.http, &rig.image_sha),
            &[("h2", &dead)],
        )
        .unwrap(),
    );
    run(async {
        let hosts = hosts_for(&config);
        let p = provider_with(
            &config,
            Arc::new(LibvirtOps::new(hosts.clone())),
            cache_options(),
        );
        let inst = p.create(&request(&uid(80), "listed")).await.unwrap();
        assert_eq!(inst.id.host, "h1");
        for round in 0..2 {
            let mut listing = p.list().await;
            listing.sort_by(|a, b| a.target.cmp(&b.target));
            let targets: Vec<&str> = listing.iter().map(|l| l.target.as_str()).collect();
            assert_eq!(targets, ["h1", "h2"], "round {round}");
            let h1 = listing[0].result.as_ref().unwrap();
            assert_eq!(h1.len(), 1, "round {round}: {h1:?}");
            assert_eq!(h1[0].id, inst.id);
            assert_eq!(h1[0].proxy.name, "listed");
            match &listing[1].result {
                Ok(found) => panic!("round {round}: the dead host listed as Ok({found:?})"),
                Err(e) => assert_eq!(e.class(), ErrorClass::Transient, "round {round}: {e}"),
            }
        }
        p.delete(&inst.id).await.unwrap();
        assert!(rig.domains().is_empty());
        hosts.close().await;
        rig.hosts.close().await;
    });
}

#[test]
fn upload_progress_reaches_the_image_size() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let size = std::fs::metadata(rig.images_dir.path().join("base.qcow2"))
        .unwrap()
        .len();
    run(async {
        let seen: Arc<Mutex<Vec<UploadProgress>>> = Arc::default();
        let sink = seen.clone();
        let options = ImageCacheOptions {
            progress: Some(Arc::new(move |p: &UploadProgress| {
                sink.lock().unwrap().push(p.clone());
            })),
            ..cache_options()
        };
        let p = provider_with(&rig.config, rig.ops.clone(), options);
        let inst = p.create(&request(&uid(90), "progress")).await.unwrap();
        let calls = seen.lock().unwrap().clone();
        assert!(calls.len() >= 2, "progress in steps: {calls:?}");
        let last = calls.last().unwrap();
        assert_eq!((last.done, last.total), (size, size), "{last:?}");
        assert!(
            calls.windows(2).all(|w| w[0].done < w[1].done),
            "strictly growing"
        );
        assert!(
            calls
                .iter()
                .all(|c| c.host == "h1" && c.image == "base" && c.total == size),
            "{calls:?}"
        );

        // A cached image reports no upload.
        let again = p.create(&request(&uid(91), "cached")).await.unwrap();
        assert_eq!(seen.lock().unwrap().len(), calls.len());
        p.delete(&inst.id).await.unwrap();
        p.delete(&again.id).await.unwrap();
        assert!(rig.domains().is_empty());
        rig.hosts.close().await;
    });
}

// ---------------------------------------------------------------------------------------
// Virtual size and deadlines

/// The rig's config plus an image `slow` with the same content, served from `url`.
fn with_slow_image(config: &ValidConfig, url: &str) -> Arc<ValidConfig> {
    let mut raw: ProvidersConfig = (**config).clone();
    let mut slow = raw.kvm2.images[0].clone();
    slow.name = "slow".into();
    slow.url = url.into();
    raw.kvm2.images.push(slow);
    let yaml = serde_yaml_ng::to_string(&raw).unwrap();
    Arc::new(
        egress_operator::config::parse(&yaml, "slow-config", std::path::Path::new("/")).unwrap(),
    )
}

/// A server that sends the rig's base image in about 30 steps of 100 ms: never idle for
/// long, about three seconds in all.
fn slow_server(rig: &Rig) -> HttpServer {
    let bytes = std::fs::read(rig.images_dir.path().join("base.qcow2")).unwrap();
    let chunk = bytes.len().div_ceil(30);
    HttpServer::start(vec![(
        "/slow.qcow2".into(),
        Route::Slow {
            body: Arc::new(bytes),
            chunk,
            pause: Duration::from_millis(100),
        },
    )])
    .unwrap()
}

/// On real libvirt: the marker's capacity is the qcow2 header's virtual size (64 MiB, the
/// file is a few hundred KB), and it allocates nothing; the overlay is the machine type's
/// disk (1 GiB), larger than both.
#[test]
fn the_marker_records_the_virtual_size_and_allocates_nothing() {
    use std::os::unix::fs::MetadataExt as _;
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let inst = p.create(&request(&uid(92), "sized")).await.unwrap();
        let marker = image_marker_name(&rig.image_sha);
        assert_eq!(capacity(&rig, &marker), 64 << 20);
        let blocks = std::fs::metadata(rig.pool_dir.join(&marker))
            .unwrap()
            .blocks();
        assert!(blocks <= 8, "the marker allocated {blocks} blocks");
        let root = InstanceIdentity::for_uid(&uid(92)).unwrap().root_volume;
        assert_eq!(capacity(&rig, &root), 1 << 30);
        p.delete(&inst.id).await.unwrap();
        let mut base = rig.base_volumes();
        base.sort();
        assert_eq!(rig.volumes(), base, "no heartbeat or claim left");
        rig.hosts.close().await;
    });
}

/// A download that takes about three seconds, within its own deadline, feeding a libvirt
/// upload whose own deadline is one second: the upload does not time out, because waiting
/// on the HTTP server is not counted against it. (It was: the upload call's deadline ran
/// from the first byte, so a slow server failed it as a libvirt timeout.)
#[test]
fn a_slow_download_within_its_deadline_does_not_time_out_the_upload() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let slow = slow_server(&rig);
    let config = with_slow_image(&rig.config, &slow.url("/slow.qcow2"));
    run(async {
        let options = ImageCacheOptions {
            min_upload_deadline: Duration::from_secs(1),
            fetch: FetchPolicy {
                min_download_deadline: Duration::from_secs(60),
                ..FetchPolicy::default()
            },
            ..cache_options()
        };
        let p = provider_with(&config, rig.ops.clone(), options);
        let inst = p.create(&request_image(93, "slow", "slow")).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(slow.hits("/slow.qcow2"), 1);
        p.delete(&inst.id).await.unwrap();
        rig.hosts.close().await;
    });
}

/// A download that cannot finish within its deadline fails that Create only: a typed,
/// transient "too slow" error naming the image (not a libvirt or link error), nothing is
/// left in the pool, and the next Create on the same host and link succeeds.
#[test]
fn a_download_past_its_deadline_fails_that_create_only() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let slow = slow_server(&rig);
    let config = with_slow_image(&rig.config, &slow.url("/slow.qcow2"));
    run(async {
        let options = ImageCacheOptions {
            fetch: FetchPolicy {
                min_download_deadline: Duration::from_secs(1),
                min_bytes_per_sec: u64::MAX,
                ..FetchPolicy::default()
            },
            ..cache_options()
        };
        let p = provider_with(&config, rig.ops.clone(), options);
        let e = create_fails(&p, &request_image(94, "slow", "slow")).await;
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        let msg = e.to_string();
        assert!(msg.contains("kvm2.images[slow]"), "{msg}");
        assert!(msg.contains("too slow"), "{msg}");
        assert!(!msg.contains("libvirt"), "{msg}");
        assert_nothing_left(&rig, "too slow");
        // The same host, the same hosts table: the link was not torn down for it.
        let inst = p.create(&request_image(95, "fast", "base")).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        p.delete(&inst.id).await.unwrap();
        rig.hosts.close().await;
    });
}
