//! The elector against an in-memory Lease API (`fake`): handover, crashes, guarded writes,
//! renewals that fail for a while, and the fence a deposed replica stops behind.

mod fake;
mod fencing;
mod guarded;
mod handover;
mod options;
mod renewal;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;

use super::lease::{LeaseApi, Observed, Round, Take};
use super::*;
use fake::{FakeApi, HolderChange, client};

fn options(identity: &str, duration_secs: u64, renew_before_secs: u64) -> LeaderOptions {
    LeaderOptions {
        lease_duration: Duration::from_secs(duration_secs),
        renew_before_expiry: Duration::from_secs(renew_before_secs),
        retry_period: Duration::from_millis(200),
        release_timeout: Duration::from_secs(5),
        ..LeaderOptions::new("egress-system", identity)
    }
}

/// Hang guard: generous, only there so that a broken election fails instead of hanging.
async fn within<F: Future>(secs: u64, what: &str, future: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(secs), future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {secs}s waiting for {what}"),
    }
}

#[derive(Debug, Default)]
struct Samples {
    total: usize,
    both: usize,
    first: usize,
    second: usize,
}

/// Samples two replicas' view of leadership every few milliseconds until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Samples>,
}

fn sample(first: Leadership, second: Leadership) -> Sampler {
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let task = tokio::spawn(async move {
        let mut samples = Samples::default();
        while !stopped.load(Ordering::Relaxed) {
            let (a, b) = (first.is_leader(), second.is_leader());
            samples.total += 1;
            samples.first += usize::from(a);
            samples.second += usize::from(b);
            samples.both += usize::from(a && b);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        samples
    });
    Sampler { stop, task }
}

impl Sampler {
    /// Stops sampling; fails if both replicas ever claimed to lead at once, or if either
    /// never led (then the sampling proved nothing).
    async fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.task.await.unwrap();
        assert_eq!(samples.both, 0, "both replicas led at once: {samples:?}");
        assert!(
            samples.first > 0 && samples.second > 0,
            "each replica should have led: {samples:?}"
        );
    }
}

fn manager_of(identity: &str) -> String {
    format!("{FIELD_MANAGER_PREFIX}{identity}")
}

/// Every change that took the lease away from a holder was made by that holder itself
/// (a release) or after its lease had expired.
fn assert_no_early_takeover(changes: &[HolderChange]) {
    for change in changes {
        let Some(previous) = &change.before else {
            continue;
        };
        if change.after.as_ref() == Some(previous) || change.by == manager_of(previous) {
            continue;
        }
        let expiry = change.expiry_before.unwrap();
        assert!(
            change.at > expiry,
            "{change:?} took the lease from {previous} before it expired; all changes: {changes:?}"
        );
    }
}
