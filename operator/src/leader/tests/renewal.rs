//! Stepping down only for cause (issue 33, item 3): a failed renewal is retried until the
//! renew deadline; a conflict from someone touching the Lease is re-read, not a loss; and a
//! touch is not a renewal, so a dead holder is still taken over. Before, the first failed
//! renewal (any error, or a 409) published "not leader", and a follower reset its timer on
//! every new resourceVersion.

use http::StatusCode;

use super::*;

/// Every change of `leadership` published from now on, as they come.
fn flips(leadership: &Leadership) -> watch::Receiver<bool> {
    let mut rx = leadership.subscribe();
    rx.borrow_and_update();
    rx
}

/// Someone writes the Lease (a new resourceVersion, the holder record unchanged) between
/// each of the holder's reads and its write, three times in a row: each write conflicts,
/// the holder re-reads, finds itself still the holder, and renews over the new version. It
/// never stops leading (before, the first 409 stepped it down).
#[tokio::test]
async fn a_touch_between_read_and_renewal_does_not_depose_the_holder() {
    let fake = Arc::new(FakeApi::default());
    let metrics = LeaderMetrics::default();
    let (mut a, a_elector) = LeaderElector::start_with_metrics(
        client(&fake),
        options("replica-a", 3, 1),
        metrics.clone(),
    )
    .await
    .unwrap();
    within(10, "replica-a to lead", a.acquired()).await.unwrap();
    let changes = flips(&a);
    let renewed = fake.renewals();

    fake.touch_before_updates(3);
    within(20, "renewals over a touched lease", async {
        while fake.touches_left() > 0 || fake.renewals() < renewed + 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(a.is_leader());
    assert!(
        !changes.has_changed().unwrap(),
        "replica-a published a change of leadership"
    );
    assert_eq!(metrics.step_downs("held_by_other"), 0);
    assert_eq!(metrics.step_downs("renew_deadline"), 0);
    assert_eq!(fake.changes().len(), 1, "{:?}", fake.changes());
    a_elector.shutdown().await.unwrap();
    assert!(fake.unguarded().is_empty(), "{:?}", fake.unguarded());
}

/// A burst of transient failures (500, 429, 503, 500), one per request, each failing a
/// renewal round: the holder retries every 200 ms (the retry period here), well within
/// its renew deadline (2 s of retries: a 6 s lease renewed every 2 s, stepping down 4 s
/// after its last good renewal began), and never stops leading.
#[tokio::test]
async fn transient_failures_within_the_renew_deadline_do_not_depose_the_holder() {
    let fake = Arc::new(FakeApi::default());
    let metrics = LeaderMetrics::default();
    let (mut a, a_elector) = LeaderElector::start_with_metrics(
        client(&fake),
        options("replica-a", 6, 4),
        metrics.clone(),
    )
    .await
    .unwrap();
    within(10, "replica-a to lead", a.acquired()).await.unwrap();
    let changes = flips(&a);
    let renewed = fake.renewals();

    let burst = [
        StatusCode::INTERNAL_SERVER_ERROR,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::SERVICE_UNAVAILABLE,
        StatusCode::INTERNAL_SERVER_ERROR,
    ];
    fake.fail_next(&burst);
    within(20, "renewals after the burst", async {
        while fake.failures_left() > 0 || fake.renewals() < renewed + 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(a.is_leader());
    assert!(
        !changes.has_changed().unwrap(),
        "replica-a published a change of leadership"
    );
    assert_eq!(metrics.renewal_retries(), burst.len() as u64);
    assert_eq!(metrics.step_downs("renew_deadline"), 0);
    a_elector.shutdown().await.unwrap();
}

/// Failures that outlast the renew deadline still step the holder down, once, and it
/// leads again when the API answers (the retries must not keep a replica leading that
/// cannot renew).
#[tokio::test]
async fn failures_past_the_renew_deadline_step_down_once() {
    let fake = Arc::new(FakeApi::default());
    let metrics = LeaderMetrics::default();
    let (mut a, a_elector) = LeaderElector::start_with_metrics(
        client(&fake),
        options("replica-a", 4, 2),
        metrics.clone(),
    )
    .await
    .unwrap();
    within(10, "replica-a to lead", a.acquired()).await.unwrap();
    fake.set_failing(true);
    within(10, "replica-a to step down", a.lost()).await;
    assert!(metrics.renewal_retries() > 0, "no renewal was retried");
    assert_eq!(metrics.step_downs("renew_deadline"), 1);
    fake.set_failing(false);
    within(15, "replica-a to lead again", a.acquired())
        .await
        .unwrap();
    assert_eq!(metrics.step_downs("renew_deadline"), 1);
    assert_eq!(metrics.step_downs("held_by_other"), 0);
    a_elector.shutdown().await.unwrap();
}

/// The holder dies while someone keeps touching the Lease (every 200 ms, far more often
/// than the 3 s lease duration): the follower still takes over once it has seen the same
/// holder record for the lease duration, and not before. Before, every new
/// resourceVersion restarted the follower's clock, so the dead holder kept the lease
/// forever. The follower's first write also conflicts with a touch: it re-reads and takes
/// the lease at once.
#[tokio::test]
async fn a_dead_holder_is_taken_over_although_someone_touches_the_lease() {
    let fake = Arc::new(FakeApi::default());
    let (mut a, a_elector) = LeaderElector::start(client(&fake), options("replica-a", 3, 1))
        .await
        .unwrap();
    within(10, "replica-a to lead", a.acquired()).await.unwrap();
    let (mut b, b_elector) = LeaderElector::start(client(&fake), options("replica-b", 3, 1))
        .await
        .unwrap();
    let sampler = sample(a.clone(), b.clone());

    let stop = Arc::new(AtomicBool::new(false));
    let toucher = tokio::spawn({
        let (fake, stop) = (fake.clone(), stop.clone());
        async move {
            while !stop.load(Ordering::Relaxed) {
                fake.touch();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    a_elector.abort();
    fake.touch_before_updates(1);
    within(20, "replica-b to take over", b.acquired())
        .await
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    toucher.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    sampler.finish().await;
    assert_eq!(
        fake.touches_left(),
        0,
        "replica-b's first write was touched"
    );
    assert_no_early_takeover(&fake.changes());
    b_elector.shutdown().await.unwrap();
    assert!(fake.unguarded().is_empty(), "{:?}", fake.unguarded());
}
