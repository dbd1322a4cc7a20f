//! Every write is guarded by the version of the read it is based on.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{Map, json};

use super::fake::{StoredLease, key};

use super::*;

/// Two followers read the same expired lease; one takes it; the other's write, based on
/// its stale read, must fail instead of wiping (or overwriting) the new hold.
/// `kube-lease-manager` released an expired lease with an unconditional patch, so the
/// slower follower cleared the faster one's fresh hold and both led.
#[tokio::test]
async fn a_write_based_on_a_stale_read_cannot_take_or_wipe_a_fresh_hold() {
    let fake = Arc::new(FakeApi::default());
    // An expired hold by a crashed replica.
    {
        let mut state = fake.state.lock().unwrap();
        state.resource_version = 7;
        let mut spec = Map::new();
        spec.insert("holderIdentity".into(), json!("crashed"));
        spec.insert("leaseDurationSeconds".into(), json!(1));
        spec.insert("renewTime".into(), json!("2020-01-01T00:00:00.000000Z"));
        state.leases.insert(
            key("egress-system", DEFAULT_LEASE_NAME),
            StoredLease {
                spec,
                owners: BTreeMap::new(),
                resource_version: 7,
            },
        );
    }
    let a = LeaseApi::new(client(&fake), &options("replica-a", 3, 1), 3);
    let b = LeaseApi::new(client(&fake), &options("replica-b", 3, 1), 3);
    let (mut seen_a, mut seen_b) = (Observed::default(), Observed::default());
    let read_a = a.read_or_create().await.unwrap();
    let read_b = b.read_or_create().await.unwrap();
    seen_a.saw(&read_a);
    seen_b.saw(&read_b);
    // Both have watched the crashed hold, unchanged, for longer than its duration.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    assert_eq!(
        a.take(&read_a, &mut seen_a).await.unwrap(),
        Take::Taken,
        "a takes it"
    );
    assert_eq!(
        b.take(&read_b, &mut seen_b).await.unwrap(),
        Take::Stale,
        "b's write was based on the version before a's"
    );
    assert_eq!(fake.holder().as_deref(), Some("replica-a"));
    // b re-reads: a fresh hold, so b follows.
    assert_eq!(
        b.acquire_or_renew(&mut seen_b).await.unwrap(),
        Round::HeldByOther
    );
    assert_eq!(fake.holder().as_deref(), Some("replica-a"));
    assert_eq!(
        a.acquire_or_renew(&mut seen_a).await.unwrap(),
        Round::Held,
        "a renews"
    );
    let changes = fake.changes();
    assert_eq!(changes.len(), 1, "one change of holder: {changes:?}");
    assert!(fake.unguarded().is_empty(), "{:?}", fake.unguarded());
}

/// Three replicas, the holder killed and restarted over and over: at most one leads at
/// any sample, and no write of any replica is unguarded.
#[tokio::test]
async fn three_replicas_never_lead_together_and_every_write_is_guarded() {
    let fake = Arc::new(FakeApi::default());
    let mut replicas = Vec::new();
    for id in ["replica-a", "replica-b", "replica-c"] {
        let (l, e) = LeaderElector::start(client(&fake), options(id, 2, 1))
            .await
            .unwrap();
        replicas.push((id.to_string(), l, Some(e)));
    }
    let views: Arc<Mutex<Vec<Leadership>>> =
        Arc::new(Mutex::new(replicas.iter().map(|r| r.1.clone()).collect()));
    let sampled = Arc::clone(&views);
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let sampler = tokio::spawn(async move {
        let mut both = 0;
        while !stopped.load(Ordering::Relaxed) {
            if sampled
                .lock()
                .unwrap()
                .iter()
                .filter(|v| v.is_leader())
                .count()
                > 1
            {
                both += 1;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        both
    });
    for round in 0..3 {
        let leader = within(15, "a leader", async {
            loop {
                if let Some(i) = replicas.iter().position(|r| r.1.is_leader()) {
                    return i;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        // Killed without a release: the others must wait out the lease. It comes back
        // as a new pod (a new identity).
        if let Some(e) = replicas[leader].2.take() {
            e.abort();
        }
        let id = format!("{}-{round}", replicas[leader].0);
        let (l, e) = LeaderElector::start(client(&fake), options(&id, 2, 1))
            .await
            .unwrap();
        views.lock().unwrap()[leader] = l.clone();
        replicas[leader] = (id, l, Some(e));
    }
    stop.store(true, Ordering::Relaxed);
    assert_eq!(sampler.await.unwrap(), 0, "two replicas led at once");
    assert_no_early_takeover(&fake.changes());
    for (_, _, e) in replicas {
        if let Some(e) = e {
            e.shutdown().await.unwrap();
        }
    }
    assert!(fake.unguarded().is_empty(), "{:?}", fake.unguarded());
    assert!(fake.unexpected().is_empty(), "{:?}", fake.unexpected());
}
