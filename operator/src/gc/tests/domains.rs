//! The domain collector.

use super::*;

#[tokio::test]
async fn an_orphan_past_the_grace_period_is_deleted() {
    let (fake, _index, gc) = setup(&["a"]);
    fake.insert(instance("a", "u1", &ago(i64::from(GRACE) + 1)));
    let report = gc.sweep_once().await;
    assert_eq!(report.deleted_ids(), vec![&id("a", "egress-u1")]);
    assert_eq!(report.deleted[0].reason, OrphanReason::NoProxy);
    assert_eq!(report.deleted[0].proxy_uid, "u1");
    assert!(ids(&fake).is_empty());
}

#[tokio::test]
async fn an_orphan_within_the_grace_period_is_kept() {
    let (fake, _index, gc) = setup(&["a"]);
    fake.insert(instance("a", "u1", &ago(i64::from(GRACE) - 1)));
    let report = gc.sweep_once().await;
    assert!(report.deleted.is_empty());
    assert!(matches!(
        report.kept_reason(&id("a", "egress-u1")),
        Some(KeepReason::Young { age_seconds: 599 })
    ));
    assert_eq!(deletes(&fake), 0);
    assert_eq!(ids(&fake).len(), 1);
}

#[tokio::test]
async fn an_instance_that_cannot_be_dated_is_kept() {
    let (fake, _index, gc) = setup(&["a"]);
    fake.insert(instance("a", "u1", "last tuesday"));
    let report = gc.sweep_once().await;
    assert_eq!(
        report.kept_reason(&id("a", "egress-u1")),
        Some(&KeepReason::Undatable {
            created_at: "last tuesday".into()
        })
    );
    assert_eq!(deletes(&fake), 0);
}

#[tokio::test]
async fn a_failed_target_listing_skips_that_target_only() {
    let (fake, _index, gc) = setup(&["a", "b"]);
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("b", "u2", &ago(7200)));
    fake.set_down("a", true);
    let report = gc.sweep_once().await;
    assert_eq!(report.skipped_targets.len(), 1);
    assert_eq!(report.skipped_targets[0].target, "a");
    assert_eq!(report.skipped_targets[0].class, ErrorClass::Transient);
    assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u2")]);
    assert!(report.failed.is_empty(), "no delete was tried on target a");
    assert_eq!(deletes(&fake), 1);
    assert_eq!(ids(&fake), vec![id("a", "egress-u1")]);
    assert_eq!(gc.metrics().sweeps("partial"), 1);
}

#[tokio::test]
async fn a_failed_proxy_listing_deletes_nothing() {
    let (fake, index, gc) = setup(&["a", "b"]);
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("b", "u2", &ago(7200)));
    index.fail_next(ErrorClass::Transient);
    let report = gc.sweep_once().await;
    assert!(report.owners_error.is_some());
    assert!(report.deleted.is_empty() && report.failed.is_empty());
    assert_eq!(deletes(&fake), 0);
    assert_eq!(ids(&fake).len(), 2);
    assert_eq!(gc.metrics().sweeps("skipped"), 1);
    // The same instances are collected once the Proxies can be listed.
    let report = gc.sweep_once().await;
    assert_eq!(report.deleted.len(), 2);
}

#[tokio::test]
async fn a_duplicate_past_the_grace_period_is_deleted_and_the_named_one_kept() {
    let (fake, index, gc) = setup(&["a", "b", "c"]);
    let named = id("a", "egress-u1");
    index.insert("u1", owner(Some(named.clone())));
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("b", "u1", &ago(7200)));
    fake.insert(instance("c", "u1", &ago(10)));
    let report = gc.sweep_once().await;
    assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u1")]);
    assert_eq!(
        report.deleted[0].reason,
        OrphanReason::Duplicate {
            named: named.clone()
        }
    );
    assert_eq!(report.kept_reason(&named), Some(&KeepReason::Named));
    assert!(matches!(
        report.kept_reason(&id("c", "egress-u1")),
        Some(KeepReason::Young { .. })
    ));
    assert_eq!(ids(&fake), vec![named, id("c", "egress-u1")]);
}

#[tokio::test]
async fn a_proxy_that_names_no_instance_yet_keeps_all_of_its_instances() {
    let (fake, index, gc) = setup(&["a", "b"]);
    index.insert("u1", owner(None));
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("b", "u1", &ago(7200)));
    let report = gc.sweep_once().await;
    assert!(report.deleted.is_empty());
    assert_eq!(
        report.kept_reason(&id("a", "egress-u1")),
        Some(&KeepReason::NotYetNamed)
    );
    assert_eq!(
        report.kept_reason(&id("b", "egress-u1")),
        Some(&KeepReason::NotYetNamed)
    );
    assert_eq!(deletes(&fake), 0);
}

#[tokio::test]
async fn an_instance_without_an_owner_uid_is_kept() {
    let (fake, _index, gc) = setup(&["a"]);
    fake.insert(instance("a", "", &ago(7200)));
    let report = gc.sweep_once().await;
    assert_eq!(
        report.kept_reason(&id("a", "egress-")),
        Some(&KeepReason::NoOwnerUid)
    );
    assert_eq!(deletes(&fake), 0);
}

#[tokio::test]
async fn a_failed_delete_does_not_stop_the_sweep() {
    let (fake, _index, gc) = setup(&["a"]);
    for uid in ["u1", "u2", "u3"] {
        fake.insert(instance("a", uid, &ago(7200)));
    }
    fake.fail_next("delete", ErrorClass::Transient);
    let report = gc.sweep_once().await;
    assert_eq!(report.failed.len(), 1);
    assert_eq!(report.failed[0].error.class(), ErrorClass::Transient);
    assert_eq!(report.failed[0].instance.id, id("a", "egress-u1"));
    assert_eq!(report.deleted.len(), 2);
    assert_eq!(ids(&fake), vec![id("a", "egress-u1")]);
    assert_eq!(gc.metrics().deletes("fake", "transient"), 1);
    assert_eq!(gc.metrics().deletes("fake", "ok"), 2);
}

#[tokio::test]
async fn a_sweep_is_counted_in_the_metrics() {
    let mut registry = Registry::default();
    let metrics = GcMetrics::register(&mut registry);
    let fake = Arc::new(FakeProvider::new(&["a", "b"]));
    let index = Arc::new(FakeProxyIndex::new());
    let gc = collector(vec![fake.clone()], index.clone(), metrics);
    index.insert("u2", owner(Some(id("a", "egress-u2"))));
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("a", "u2", &ago(7200)));
    fake.insert(instance("a", "u3", &ago(7200)));
    fake.set_down("b", true);
    fake.fail_next("delete", ErrorClass::Quota);
    gc.sweep_once().await;

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "egress_gc_sweeps_total{result=\"partial\"} 1",
        "egress_gc_instances_seen_total{provider=\"fake\"} 3",
        "egress_gc_orphans_total{provider=\"fake\",reason=\"no-proxy\"} 2",
        "egress_gc_deletes_total{provider=\"fake\",outcome=\"quota\"} 1",
        "egress_gc_deletes_total{provider=\"fake\",outcome=\"ok\"} 1",
        "egress_gc_targets_skipped_total{provider=\"fake\",target=\"b\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
    let stamp = text
        .lines()
        .find_map(|l| l.strip_prefix("egress_gc_last_sweep_timestamp_seconds "))
        .unwrap();
    assert!(stamp.parse::<f64>().unwrap() > 1.0e9, "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("egress_gc_last_sweep_duration_seconds ")),
        "{text}"
    );
}

#[tokio::test]
async fn run_stops_on_shutdown() {
    let (fake, index, gc) = setup(&["a"]);
    fake.insert(instance("a", "u1", &ago(7200)));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(gc.run(async move {
        let _ = rx.await;
    }));
    // The first tick is immediate: wait for that sweep, then ask to stop while the
    // collector waits an hour for the next one.
    tokio::time::timeout(Duration::from_secs(5), async {
        while ids(&fake).len() == 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(index.calls(), 1);
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("run() did not stop on shutdown")
        .unwrap();
}

/// Delegates to a [`FakeProvider`], but every delete waits to be released.
struct Gated {
    inner: Arc<FakeProvider>,
    entered: Notify,
    release: Notify,
}

impl Provider for Gated {
    fn name(&self) -> &str {
        "gated"
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.inner.create(req)
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        self.inner.get(id)
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            self.entered.notify_one();
            self.release.notified().await;
            self.inner.delete(id).await
        })
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        self.inner.list()
    }
}

#[tokio::test]
async fn shutdown_during_a_delete_finishes_that_delete_and_starts_no_other() {
    let fake = Arc::new(FakeProvider::new(&["a"]));
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("a", "u2", &ago(7200)));
    let gated = Arc::new(Gated {
        inner: fake.clone(),
        entered: Notify::new(),
        release: Notify::new(),
    });
    let index = Arc::new(FakeProxyIndex::new());
    let gc = collector(vec![gated.clone()], index, GcMetrics::default());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(gc.run(async move {
        let _ = rx.await;
    }));
    tokio::time::timeout(Duration::from_secs(5), gated.entered.notified())
        .await
        .unwrap();
    tx.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !task.is_finished(),
        "run() returned with a delete in flight"
    );
    gated.release.notify_one();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("run() did not stop after the delete")
        .unwrap();
    assert_eq!(
        ids(&fake),
        vec![id("a", "egress-u2")],
        "first delete done, second not started"
    );
}

fn provisioning(instance_id: Option<InstanceId>) -> Owner {
    Owner {
        provisioning: true,
        ..owner(instance_id)
    }
}

#[tokio::test]
async fn a_duplicate_of_a_provisioning_proxy_is_kept() {
    let (fake, index, gc) = setup(&["a", "b"]);
    let named = id("a", "egress-u1");
    // The status still names the old instance while a replacement is made on b.
    index.insert("u1", provisioning(Some(named.clone())));
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("b", "u1", &ago(7200)));
    let report = gc.sweep_once().await;
    assert!(report.deleted.is_empty(), "{:?}", report.deleted);
    assert_eq!(
        report.kept_reason(&id("b", "egress-u1")),
        Some(&KeepReason::CreateInProgress)
    );
    assert_eq!(deletes(&fake), 0);
    // Once the Proxy runs on a, the leftover on b is collected.
    index.insert("u1", owner(Some(named)));
    let report = gc.sweep_once().await;
    assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u1")]);
}

#[tokio::test]
async fn the_proxy_is_read_again_right_before_each_delete() {
    let (fake, index, gc) = setup(&["a", "b"]);
    index.insert("u1", owner(Some(id("a", "egress-u1"))));
    fake.insert(instance("a", "u1", &ago(7200)));
    fake.insert(instance("b", "u1", &ago(7200)));
    fake.insert(instance("b", "u2", &ago(7200)));
    // The listing is taken before the controller names the instance on b and a
    // Proxy u2 is created (a UID the listing did not have).
    index.freeze_listing();
    index.insert("u1", owner(Some(id("b", "egress-u1"))));
    index.insert("u2", provisioning(None));
    let report = gc.sweep_once().await;
    assert_eq!(
        report.kept_reason(&id("b", "egress-u1")),
        Some(&KeepReason::Named)
    );
    assert_eq!(
        report.kept_reason(&id("b", "egress-u2")),
        Some(&KeepReason::NotYetNamed)
    );
    // The instance on a is now the duplicate, but the listing said it was named:
    // it waits for the next sweep.
    assert_eq!(
        report.kept_reason(&id("a", "egress-u1")),
        Some(&KeepReason::Named)
    );
    assert_eq!(deletes(&fake), 0);
    assert_eq!(index.rereads(), 2);
}

#[tokio::test]
async fn a_failed_reread_deletes_nothing() {
    let (fake, index, gc) = setup(&["a"]);
    fake.insert(instance("a", "u1", &ago(7200)));
    index.fail_rereads(ErrorClass::Transient);
    let report = gc.sweep_once().await;
    assert!(report.deleted.is_empty());
    assert_eq!(
        report.kept_reason(&id("a", "egress-u1")),
        Some(&KeepReason::Unconfirmed {
            class: ErrorClass::Transient
        })
    );
    assert_eq!(deletes(&fake), 0);
}

#[tokio::test]
async fn instances_on_hosts_no_longer_configured_are_reported() {
    let mut registry = Registry::default();
    let metrics = GcMetrics::register(&mut registry);
    let fake = Arc::new(FakeProvider::new(&["a"]));
    let index = Arc::new(FakeProxyIndex::new());
    let gc = collector(vec![fake.clone()], index.clone(), metrics);
    index.insert("u1", owner(Some(id("gone", "egress-u1"))));
    index.insert("u2", owner(Some(id("gone", "egress-u2"))));
    index.insert("u3", owner(Some(id("a", "egress-u3"))));
    fake.insert(instance("a", "u3", &ago(7200)));
    let report = gc.sweep_once().await;
    let hosts: Vec<_> = report
        .unconfigured
        .iter()
        .map(|u| u.instance.to_string())
        .collect();
    assert_eq!(hosts, ["gone/egress-u1", "gone/egress-u2"]);
    assert_eq!(gc.metrics().unconfigured("gone"), 2);
    assert_eq!(deletes(&fake), 0);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "egress_gc_unconfigured_host_instances{host=\"gone\"} 2"),
        "{text}"
    );
    // Once no Proxy names it, the host's gauge goes back to zero.
    index.remove("u1");
    index.remove("u2");
    gc.sweep_once().await;
    assert_eq!(gc.metrics().unconfigured("gone"), 0);
}
