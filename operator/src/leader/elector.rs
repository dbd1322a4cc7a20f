//! The elector's background loop: take the lease, renew it, retry a failed renewal until
//! the renew deadline, step down for cause only, release it at shutdown.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use super::lease::{LeaseApi, Observed, Round, is_refusal};
use super::{LeaderError, LeaderOptions};

/// First wait after a failed round; doubles up to the retry period while leading (so a
/// failing renewal gets several tries before its deadline) and up to the lease duration
/// otherwise.
const FIRST_ERROR_BACKOFF: Duration = Duration::from_millis(500);

/// Why the holder stepped down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepDown {
    /// No renewal succeeded by the renew deadline.
    RenewDeadline,
    /// A read named another holder.
    HeldByOther,
}

impl StepDown {
    fn label(self) -> &'static str {
        match self {
            StepDown::RenewDeadline => "renew_deadline",
            StepDown::HeldByOther => "held_by_other",
        }
    }
}

/// Labels of [`LeaderMetrics`]' step-downs.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepDownLabels {
    /// `renew_deadline` (no renewal succeeded in time) or `held_by_other`.
    pub reason: String,
}

/// What the elector did besides leading: renewals that failed and were tried again, and
/// step-downs by cause. A healthy pair of replicas shows retries now and then (an API
/// server restart) and no step-down.
#[derive(Debug, Clone, Default)]
pub struct LeaderMetrics {
    leading: Gauge,
    renewal_retries: Counter,
    step_downs: Family<StepDownLabels, Counter>,
}

impl LeaderMetrics {
    /// Registered under `egress_leader_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_leader_is_leader",
            "1 while this replica holds the leader lease; the fleet has no leader when no \
             replica reports 1",
            m.leading.clone(),
        );
        registry.register(
            "egress_leader_renewal_retries",
            "renewals of the leader lease that failed and were tried again within the renew deadline",
            m.renewal_retries.clone(),
        );
        registry.register(
            "egress_leader_step_downs",
            "times this replica stopped leading, by reason (renew_deadline, held_by_other)",
            m.step_downs.clone(),
        );
        m
    }

    /// Shows whether this replica leads; the elector does this itself, a replica run without
    /// leader election says it leads once at start.
    pub fn set_leading(&self, leading: bool) {
        self.leading.set(i64::from(leading));
    }

    /// 1 while this replica leads (for tests).
    pub fn is_leader(&self) -> i64 {
        self.leading.get()
    }

    /// Renewals retried so far (for tests).
    pub fn renewal_retries(&self) -> u64 {
        self.renewal_retries.get()
    }

    /// Step-downs for `reason` so far (for tests).
    pub fn step_downs(&self, reason: &str) -> u64 {
        self.step_downs
            .get_or_create(&StepDownLabels {
                reason: reason.into(),
            })
            .get()
    }

    fn stepped_down(&self, why: StepDown) {
        self.step_downs
            .get_or_create(&StepDownLabels {
                reason: why.label().into(),
            })
            .inc();
    }
}

/// The background task's state.
pub(super) struct Runner {
    api: LeaseApi,
    options: LeaderOptions,
    /// `namespace/name`, for logs.
    lease: String,
    /// How often the holder renews: `lease_duration - renew_before_expiry`.
    renew_every: Duration,
    metrics: LeaderMetrics,
}

impl Runner {
    pub(super) fn new(
        api: LeaseApi,
        options: LeaderOptions,
        renew_every: Duration,
        metrics: LeaderMetrics,
    ) -> Self {
        Runner {
            api,
            lease: format!("{}/{}", options.namespace, options.lease_name),
            options,
            renew_every,
            metrics,
        }
    }

    /// Makes sure the Lease exists and we may read it, so that start-up reports a
    /// misconfiguration instead of retrying it forever.
    pub(super) async fn reach(&self) -> Result<(), LeaderError> {
        self.api
            .read_or_create()
            .await
            .map(|_| ())
            .map_err(|e| self.error(e))
    }

    fn error(&self, source: kube::Error) -> LeaderError {
        LeaderError::Lease {
            namespace: self.options.namespace.clone(),
            name: self.options.lease_name.clone(),
            source,
        }
    }

    fn step_down(&self, tx: &watch::Sender<bool>, why: StepDown, cause: &str) {
        if !publish(tx, false, &self.metrics) {
            return;
        }
        self.metrics.stepped_down(why);
        let identity = self.options.identity.as_str();
        let lease = self.lease.as_str();
        match why {
            StepDown::HeldByOther => {
                info!(%identity, %lease, "lost leadership: the lease is held by another replica");
            }
            StepDown::RenewDeadline => warn!(
                %identity,
                %lease,
                error = %cause,
                deadline = ?self.options.renew_deadline(),
                "lost leadership: no renewal succeeded within the renew deadline"
            ),
        }
    }

    pub(super) async fn run(
        self,
        tx: watch::Sender<bool>,
        mut shutdown: oneshot::Receiver<()>,
    ) -> Result<(), LeaderError> {
        let identity = self.options.identity.as_str();
        let lease = self.lease.as_str();
        let mut backoff = FIRST_ERROR_BACKOFF;
        let mut observed = Observed::default();
        // Whether the Lease was ever read or written: until then a refusal (401/403) is a
        // misconfiguration (a Lease name or namespace the Role does not cover, a missing
        // binding) that retrying cannot fix, so the elector fails and the process exits
        // naming the Lease, instead of standing by forever.
        let mut reached = false;
        // Start of the last attempt that took or renewed the lease: the record a follower
        // times was written after it, so the lease cannot expire in a follower's eyes before
        // `held_since + lease_duration`.
        let mut held_since: Option<Instant> = None;
        // Why the last round failed, for the step-down's log line.
        let mut last_failure = String::new();
        loop {
            let started = Instant::now();
            // While leading: when to give up renewing. It leaves the fencing margin before
            // any follower could take over.
            let deadline = held_since
                .filter(|_| *tx.borrow())
                .map(|since| since + self.options.renew_deadline());
            if let Some(deadline) = deadline
                && started >= deadline
            {
                held_since = None;
                self.step_down(&tx, StepDown::RenewDeadline, &last_failure);
                // Judge afresh as a follower at once: the lease may still name us.
                continue;
            }
            let bound = deadline.map_or(self.options.lease_duration, |d| d - started);
            let attempt = tokio::select! {
                biased;
                _ = &mut shutdown => return self.release(&tx).await,
                r = tokio::time::timeout(bound, self.api.acquire_or_renew(&mut observed)) => r,
            };
            let failure = match attempt {
                Ok(Err(e)) if !reached && is_refusal(&e) => return Err(self.error(e)),
                Ok(Ok(Round::Held)) => {
                    reached = true;
                    backoff = FIRST_ERROR_BACKOFF;
                    held_since = Some(started);
                    if publish(&tx, true, &self.metrics) {
                        info!(%identity, %lease, "acquired leadership");
                    }
                    // Counted from the attempt's start, so a slow renewal does not push
                    // the next one towards the renew deadline.
                    let wait = self.renew_every.saturating_sub(started.elapsed());
                    if sleep_or_shutdown(wait, &mut shutdown).await {
                        return self.release(&tx).await;
                    }
                    continue;
                }
                Ok(Ok(Round::HeldByOther)) => {
                    reached = true;
                    backoff = FIRST_ERROR_BACKOFF;
                    held_since = None;
                    self.step_down(&tx, StepDown::HeldByOther, "");
                    if sleep_or_shutdown(self.options.retry_period, &mut shutdown).await {
                        return self.release(&tx).await;
                    }
                    continue;
                }
                Ok(Ok(Round::Contended)) => {
                    reached = true;
                    "every write conflicted with another writer of the lease".to_string()
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {bound:?}"),
            };
            let wait = match deadline {
                // Retry within the renew deadline; the wait never passes it, so the
                // step-down (if it comes to that) is on time.
                Some(deadline) => {
                    let wait = next_backoff(&mut backoff, self.options.retry_period);
                    let left = deadline.saturating_duration_since(Instant::now());
                    let wait = last_try_wait(wait, left, self.options.retry_period);
                    self.metrics.renewal_retries.inc();
                    warn!(%identity, %lease, error = %failure, retry_in = ?wait, deadline_in = ?left, "renewing the lease failed; retrying within the renew deadline");
                    wait
                }
                None => {
                    warn!(%identity, %lease, error = %failure, "leader election failed; retrying");
                    next_backoff(&mut backoff, self.options.lease_duration)
                }
            };
            last_failure = failure;
            if sleep_or_shutdown(wait, &mut shutdown).await {
                return self.release(&tx).await;
            }
        }
    }

    /// Shutdown: step down first (the caller stops reconciling on `false`), then clear the
    /// lease if it is ours, within the release timeout.
    async fn release(&self, tx: &watch::Sender<bool>) -> Result<(), LeaderError> {
        let identity = self.options.identity.as_str();
        let lease = self.lease.as_str();
        let was_leading = publish(tx, false, &self.metrics);
        match tokio::time::timeout(self.options.release_timeout, self.api.release()).await {
            Ok(Ok(())) => {
                if was_leading {
                    info!(%identity, %lease, "released leadership");
                }
                Ok(())
            }
            Ok(Err(e)) => Err(self.error(e)),
            Err(_) => Err(LeaderError::ReleaseTimeout {
                namespace: self.options.namespace.clone(),
                name: self.options.lease_name.clone(),
                timeout: self.options.release_timeout,
            }),
        }
    }
}

/// Publishes `leading`, and shows it in `egress_leader_is_leader`; true if it changed (only
/// changes wake the receivers).
fn publish(tx: &watch::Sender<bool>, leading: bool, metrics: &LeaderMetrics) -> bool {
    metrics.leading.set(i64::from(leading));
    tx.send_if_modified(|v| {
        let changed = *v != leading;
        *v = leading;
        changed
    })
}

fn next_backoff(current: &mut Duration, max: Duration) -> Duration {
    let wait = (*current).min(max);
    *current = current.saturating_mul(2).min(max);
    wait
}

/// The wait before the next renewal try, `left` before the renew deadline. A backoff that
/// reaches the deadline would sleep through the last stretch and step down without trying
/// again (with client-go's timings the fourth wait does, when a fault ends late in the
/// window or answers are slow); so the last stretch gets one more try half a retry period
/// before the deadline, and only a stretch shorter than that is slept through.
fn last_try_wait(wait: Duration, left: Duration, retry_period: Duration) -> Duration {
    let margin = retry_period / 2;
    if wait < left {
        wait
    } else if left > margin {
        left - margin
    } else {
        left
    }
}

/// Sleeps for `wait`; true if shutdown was asked for meanwhile.
async fn sleep_or_shutdown(wait: Duration, shutdown: &mut oneshot::Receiver<()>) -> bool {
    tokio::select! {
        biased;
        _ = shutdown => true,
        () = tokio::time::sleep(wait) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks a renewal that fails from the last good one (t = 0) on, with client-go's
    /// timings (renew deadline 10 s, retry period 2 s): every try is listed, and the last
    /// stretch before the deadline still holds one.
    #[test]
    fn the_last_stretch_before_the_renew_deadline_holds_one_more_try() {
        let (deadline, retry) = (Duration::from_secs(10), Duration::from_secs(2));
        // The first failure is seen at the next renewal, 5 s after the last good one.
        let mut now = Duration::from_secs(5);
        let mut backoff = FIRST_ERROR_BACKOFF;
        let mut tries = Vec::new();
        while now < deadline {
            let wait = next_backoff(&mut backoff, retry);
            now += last_try_wait(wait, deadline - now, retry);
            if now < deadline {
                tries.push(now.as_secs_f64());
            }
        }
        assert_eq!(tries, [5.5, 6.5, 8.5, 9.0]);
        assert_eq!(now, deadline, "the step-down is on time");
    }

    #[test]
    fn a_wait_short_of_the_deadline_is_kept() {
        let retry = Duration::from_secs(2);
        let ms = Duration::from_millis;
        assert_eq!(last_try_wait(ms(500), ms(4000), retry), ms(500));
        assert_eq!(last_try_wait(ms(2000), ms(1500), retry), ms(500));
        assert_eq!(last_try_wait(ms(2000), ms(800), retry), ms(800));
    }
}
