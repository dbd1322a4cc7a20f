//! Leftover instance volumes and images.

use super::*;

/// One target's candidates, or the class its listing fails with.
type FakeListing = (String, Result<Vec<VolumeCandidate>, ErrorClass>);

/// A [`VolumeCollector`] over a table of candidates per target.
#[derive(Default)]
struct FakeVolumes {
    targets: Mutex<Vec<FakeListing>>,
    changed: Mutex<Vec<String>>,
    deleted: Mutex<Vec<(String, String)>>,
}

impl FakeVolumes {
    fn set(&self, target: &str, listing: Result<Vec<VolumeCandidate>, ErrorClass>) {
        let mut t = self.targets.lock().unwrap();
        t.retain(|(n, _)| n != target);
        t.push((target.into(), listing));
    }
    fn deleted(&self) -> Vec<(String, String)> {
        self.deleted.lock().unwrap().clone()
    }
}

impl VolumeCollector for FakeVolumes {
    fn name(&self) -> &str {
        "fake"
    }
    fn volume_candidates(&self) -> BoxFuture<'_, Vec<VolumeListing>> {
        let out = self
            .targets
            .lock()
            .unwrap()
            .iter()
            .map(|(t, l)| VolumeListing {
                target: t.clone(),
                result: match l {
                    Ok(c) => Ok(c.clone()),
                    Err(class) => Err(ProviderError::msg(*class, "listing failed")),
                },
            })
            .collect();
        Box::pin(std::future::ready(out))
    }
    fn delete_volumes<'a>(
        &'a self,
        target: &'a str,
        candidate: &'a VolumeCandidate,
    ) -> BoxFuture<'a, Result<VolumeDeleteOutcome, ProviderError>> {
        let out = if self.changed.lock().unwrap().contains(&candidate.key) {
            VolumeDeleteOutcome::Changed("in use".into())
        } else {
            self.deleted
                .lock()
                .unwrap()
                .push((target.into(), candidate.key.clone()));
            VolumeDeleteOutcome::Deleted
        };
        Box::pin(std::future::ready(Ok(out)))
    }
}

fn candidate(key: &str, kind: VolumeKind, uid: Option<&str>) -> VolumeCandidate {
    VolumeCandidate {
        key: key.into(),
        kind,
        owner_uid: uid.map(str::to_string),
        volumes: vec![format!("{key}-vol")],
    }
}

/// A collector over `volumes` whose clock reads `at` (seconds after [`now`]).
fn volume_collector(
    volumes: Arc<FakeVolumes>,
    index: Arc<FakeProxyIndex>,
    retired: RetiredImagesPolicy,
    metrics: GcMetrics,
) -> (GarbageCollector, Arc<std::sync::atomic::AtomicI64>) {
    let at = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let clock = at.clone();
    let config = GcConfig {
        period_seconds: 3600,
        grace_period_seconds: GRACE,
        retired_images: retired,
    };
    let gc = GarbageCollector::new(vec![], index, &config, metrics)
        .with_volumes(vec![volumes])
        .with_clock(move || now() + SignedDuration::from_secs(clock.load(Ordering::SeqCst)));
    (gc, at)
}

fn policy(keep_unused: u32, unused_for_seconds: u32) -> RetiredImagesPolicy {
    RetiredImagesPolicy {
        keep_unused,
        unused_for_seconds,
    }
}

#[tokio::test]
async fn leftover_instance_volumes_go_after_the_grace_period_unless_their_proxy_exists() {
    let volumes = Arc::new(FakeVolumes::default());
    let index = Arc::new(FakeProxyIndex::new());
    let (gc, at) = volume_collector(
        volumes.clone(),
        index.clone(),
        policy(0, 0),
        GcMetrics::default(),
    );
    index.insert("u2", owner(None));
    volumes.set(
        "a",
        Ok(vec![
            candidate("egress-u1", VolumeKind::Instance, Some("u1")),
            candidate("egress-u2", VolumeKind::Instance, Some("u2")),
        ]),
    );
    let report = gc.sweep_once().await;
    assert!(volumes.deleted().is_empty());
    assert!(report.volumes_kept.iter().any(|(v, k)| v.key == "egress-u1"
        && *k
            == VolumeKeep::Young {
                seen_for_seconds: 0
            }));
    assert!(
        report
            .volumes_kept
            .iter()
            .any(|(v, k)| v.key == "egress-u2" && *k == VolumeKeep::ProxyExists)
    );

    at.store(i64::from(GRACE), Ordering::SeqCst);
    gc.sweep_once().await;
    assert!(
        volumes.deleted().is_empty(),
        "exactly the grace period is kept"
    );

    at.store(i64::from(GRACE) + 1, Ordering::SeqCst);
    let report = gc.sweep_once().await;
    assert_eq!(
        volumes.deleted(),
        [("a".to_string(), "egress-u1".to_string())]
    );
    assert_eq!(report.volumes_deleted.len(), 1);
    assert_eq!(report.volumes_deleted[0].kind, VolumeKind::Instance);
    assert_eq!(
        gc.metrics()
            .volume_deletes("fake", VolumeKind::Instance, "ok"),
        1
    );
}

#[tokio::test]
async fn a_leftover_counts_from_when_it_was_last_continuously_seen() {
    let volumes = Arc::new(FakeVolumes::default());
    let index = Arc::new(FakeProxyIndex::new());
    let (gc, at) = volume_collector(
        volumes.clone(),
        index.clone(),
        policy(0, 0),
        GcMetrics::default(),
    );
    let c = candidate("egress-u1", VolumeKind::Instance, Some("u1"));
    volumes.set("a", Ok(vec![c.clone()]));
    gc.sweep_once().await;
    // Its Proxy appears (a Create is making it): the count starts again after.
    index.insert("u1", owner(None));
    at.store(300, Ordering::SeqCst);
    gc.sweep_once().await;
    index.remove("u1");
    at.store(700, Ordering::SeqCst);
    gc.sweep_once().await;
    at.store(1200, Ordering::SeqCst);
    gc.sweep_once().await;
    assert!(
        volumes.deleted().is_empty(),
        "seen as a leftover for 500 s only"
    );
    // Not listed for a round (a domain appeared): the count starts again too.
    volumes.set("a", Ok(vec![]));
    at.store(1400, Ordering::SeqCst);
    gc.sweep_once().await;
    volumes.set("a", Ok(vec![c]));
    at.store(1500, Ordering::SeqCst);
    gc.sweep_once().await;
    at.store(2000, Ordering::SeqCst);
    gc.sweep_once().await;
    assert!(volumes.deleted().is_empty());
    at.store(2101, Ordering::SeqCst);
    gc.sweep_once().await;
    assert_eq!(volumes.deleted().len(), 1);
}

#[tokio::test]
async fn no_volume_is_deleted_on_a_target_whose_listing_failed_or_without_proxies() {
    let mut registry = Registry::default();
    let metrics = GcMetrics::register(&mut registry);
    let volumes = Arc::new(FakeVolumes::default());
    let index = Arc::new(FakeProxyIndex::new());
    let (gc, at) = volume_collector(volumes.clone(), index.clone(), policy(0, 0), metrics);
    volumes.set(
        "a",
        Ok(vec![candidate("egress-image-x", VolumeKind::Staging, None)]),
    );
    volumes.set("b", Err(ErrorClass::Transient));
    gc.sweep_once().await;
    at.store(7200, Ordering::SeqCst);
    // The Proxies cannot be listed: nothing at all is judged.
    index.fail_next(ErrorClass::Transient);
    let report = gc.sweep_once().await;
    assert!(report.volumes_deleted.is_empty() && volumes.deleted().is_empty());
    let report = gc.sweep_once().await;
    assert_eq!(
        volumes.deleted(),
        [("a".to_string(), "egress-image-x".to_string())]
    );
    assert_eq!(report.volume_targets_skipped.len(), 1);
    assert_eq!(report.volume_targets_skipped[0].target, "b");
    assert_eq!(report.result(), "partial");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "egress_gc_volume_deletes_total{provider=\"fake\",kind=\"staging\",outcome=\"ok\"} 1",
        "egress_gc_volume_targets_skipped_total{provider=\"fake\",target=\"b\"} 2",
        "egress_gc_volume_candidates_total{provider=\"fake\",kind=\"staging\"} 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
}

#[tokio::test]
async fn unused_retired_images_follow_the_policy() {
    let volumes = Arc::new(FakeVolumes::default());
    let index = Arc::new(FakeProxyIndex::new());
    // Keep the newest unused one; the others go after an hour unused.
    let (gc, at) = volume_collector(
        volumes.clone(),
        index.clone(),
        policy(1, 3600),
        GcMetrics::default(),
    );
    let old = candidate("egress-image-old", VolumeKind::UnusedImage, None);
    let older = candidate("egress-image-older", VolumeKind::UnusedImage, None);
    let newer = candidate("egress-image-newer", VolumeKind::UnusedImage, None);
    volumes.set("a", Ok(vec![old.clone(), older.clone()]));
    gc.sweep_once().await;
    at.store(1800, Ordering::SeqCst);
    volumes.set("a", Ok(vec![old.clone(), older.clone(), newer.clone()]));
    let report = gc.sweep_once().await;
    assert!(
        report
            .volumes_kept
            .iter()
            .any(|(v, k)| v.key == "egress-image-newer" && *k == VolumeKeep::Policy)
    );
    // Past the grace period but not an hour unused: kept.
    assert!(volumes.deleted().is_empty());
    at.store(3601, Ordering::SeqCst);
    let report = gc.sweep_once().await;
    let mut gone: Vec<_> = volumes.deleted().into_iter().map(|(_, k)| k).collect();
    gone.sort();
    assert_eq!(gone, ["egress-image-old", "egress-image-older"]);
    assert!(
        report
            .volumes_kept
            .iter()
            .any(|(v, k)| v.key == "egress-image-newer" && *k == VolumeKeep::Policy)
    );
    // The one kept by the policy stays however long it is unused.
    at.store(100_000, Ordering::SeqCst);
    volumes.set("a", Ok(vec![newer]));
    gc.sweep_once().await;
    assert_eq!(volumes.deleted().len(), 2);
}

#[tokio::test]
async fn a_leftover_the_provider_finds_in_use_again_is_kept_and_counted() {
    let volumes = Arc::new(FakeVolumes::default());
    let index = Arc::new(FakeProxyIndex::new());
    let (gc, at) = volume_collector(
        volumes.clone(),
        index.clone(),
        policy(0, 0),
        GcMetrics::default(),
    );
    volumes.set(
        "a",
        Ok(vec![candidate(
            "egress-u1",
            VolumeKind::Instance,
            Some("u1"),
        )]),
    );
    volumes.changed.lock().unwrap().push("egress-u1".into());
    gc.sweep_once().await;
    at.store(7200, Ordering::SeqCst);
    let report = gc.sweep_once().await;
    assert!(volumes.deleted().is_empty());
    assert!(matches!(report.volumes_kept[0].1, VolumeKeep::Changed(_)));
    assert_eq!(
        gc.metrics()
            .volume_deletes("fake", VolumeKind::Instance, "changed"),
        1
    );
}
