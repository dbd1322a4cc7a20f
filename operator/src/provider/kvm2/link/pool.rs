//! Blocking threads for libvirt calls, bounded per host and per kind of call.
//!
//! libvirt's client API blocks, so every call runs on one of tokio's blocking threads.
//! Why per host: with one shared pool, a host whose calls hang (a stuck libvirtd, a slow
//! WAN) fills every slot and calls to healthy hosts wait behind it. Why two lanes: an
//! image upload holds its thread for minutes; short calls (lookups, define, start) of the
//! same host must not queue behind a couple of uploads. So each host gets
//!
//! - a lane for ordinary calls ([`Lane::Call`], [`DEFAULT_CALLS_PER_HOST`] at once) and
//! - a lane for long transfers ([`Lane::Transfer`], [`DEFAULT_TRANSFERS_PER_HOST`]),
//!
//! and all hosts together stay under [`DEFAULT_MAX_BLOCKING_CALLS`], below tokio's 512
//! blocking threads, so stuck calls can never exhaust the runtime.
//!
//! Waiting for a slot is not a link failure: a wait that outlasts the call's deadline is
//! [`LibvirtError::Busy`] (transient), and the host's link is left alone. A call past its
//! deadline keeps its slot until its thread returns, so stuck calls count against the
//! bound instead of piling up threads.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::libvirt::LibvirtError;
use super::observe::CallMetrics;

/// Ordinary calls of one host that may run at once: far above what a reconcile needs,
/// small enough that one host's stuck calls cannot hold many threads.
pub const DEFAULT_CALLS_PER_HOST: usize = 16;
/// Long transfers (image uploads) of one host at once; more would only split the same
/// disk and link bandwidth.
pub const DEFAULT_TRANSFERS_PER_HOST: usize = 2;
/// Blocking libvirt calls of the whole process at once, whatever the host: a safety net
/// under tokio's 512 blocking threads.
pub const DEFAULT_MAX_BLOCKING_CALLS: usize = 256;

/// Which slots a call uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Lookups, define, start, stop: seconds at most.
    Call,
    /// Image uploads: minutes.
    Transfer,
}

impl Lane {
    /// The label of this lane in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Call => "call",
            Lane::Transfer => "transfer",
        }
    }
}

/// How many calls may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimits {
    /// Ordinary calls per host.
    pub calls_per_host: usize,
    /// Transfers per host.
    pub transfers_per_host: usize,
    /// All calls of all hosts.
    pub total: usize,
}

impl Default for PoolLimits {
    fn default() -> Self {
        Self {
            calls_per_host: DEFAULT_CALLS_PER_HOST,
            transfers_per_host: DEFAULT_TRANSFERS_PER_HOST,
            total: DEFAULT_MAX_BLOCKING_CALLS,
        }
    }
}

/// Where a pool reports its occupancy and slot waits.
#[derive(Debug, Clone)]
struct Gauges {
    host: String,
    metrics: Arc<CallMetrics>,
}

/// The blocking slots of one host (or of a one-off connection, such as a host check).
/// Clones share the same slots.
#[derive(Debug, Clone)]
pub struct BlockingPool {
    limits: PoolLimits,
    calls: Arc<Semaphore>,
    transfers: Arc<Semaphore>,
    /// Shared by every pool made with [`BlockingPool::for_host`] from the same root.
    total: Arc<Semaphore>,
    gauges: Option<Gauges>,
}

impl Default for BlockingPool {
    fn default() -> Self {
        Self::with_limits(PoolLimits::default())
    }
}

/// A slot: held while the call's thread runs; gives the slot back (and updates the
/// occupancy gauge) when dropped, also when the thread outlives its caller.
struct Slot {
    _lane: OwnedSemaphorePermit,
    _total: OwnedSemaphorePermit,
    in_use: Option<Gauge>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(g) = &self.in_use {
            g.dec();
        }
    }
}

impl BlockingPool {
    /// A pool running at most `max` ordinary calls at once (and the default number of
    /// transfers).
    pub fn new(max: usize) -> Self {
        Self::with_limits(PoolLimits {
            calls_per_host: max,
            ..PoolLimits::default()
        })
    }

    /// A pool with these limits.
    pub fn with_limits(limits: PoolLimits) -> Self {
        Self {
            limits,
            calls: Arc::new(Semaphore::new(limits.calls_per_host.max(1))),
            transfers: Arc::new(Semaphore::new(limits.transfers_per_host.max(1))),
            total: Arc::new(Semaphore::new(limits.total.max(1))),
            gauges: None,
        }
    }

    /// Fresh per-host lanes with the same limits, sharing this pool's process-wide bound,
    /// reporting occupancy and slot waits for `host`.
    pub fn for_host(&self, host: &str, metrics: Arc<CallMetrics>) -> Self {
        Self {
            limits: self.limits,
            calls: Arc::new(Semaphore::new(self.limits.calls_per_host.max(1))),
            transfers: Arc::new(Semaphore::new(self.limits.transfers_per_host.max(1))),
            total: Arc::clone(&self.total),
            gauges: Some(Gauges {
                host: host.to_string(),
                metrics,
            }),
        }
    }

    /// The limits.
    pub fn limits(&self) -> PoolLimits {
        self.limits
    }

    fn lane(&self, lane: Lane) -> &Arc<Semaphore> {
        match lane {
            Lane::Call => &self.calls,
            Lane::Transfer => &self.transfers,
        }
    }

    /// Waits for a slot in `lane`, at most `deadline`.
    async fn acquire(
        &self,
        op: &'static str,
        lane: Lane,
        deadline: Duration,
    ) -> Result<Slot, LibvirtError> {
        let started = tokio::time::Instant::now();
        let lane_sem = Arc::clone(self.lane(lane));
        let total = Arc::clone(&self.total);
        let wait = async move {
            let l = lane_sem.acquire_owned().await?;
            let t = total.acquire_owned().await?;
            Ok::<_, tokio::sync::AcquireError>((l, t))
        };
        let acquired = tokio::time::timeout(deadline, wait).await;
        let waited = started.elapsed();
        if let Some(g) = &self.gauges {
            g.metrics.observe_slot_wait(&g.host, lane.as_str(), waited);
        }
        match acquired {
            Err(_) => Err(LibvirtError::Busy {
                op,
                lane: lane.as_str(),
                waited: deadline,
            }),
            Ok(Err(e)) => Err(LibvirtError::Runtime {
                op,
                reason: e.to_string(),
            }),
            Ok(Ok((l, t))) => {
                let in_use = self
                    .gauges
                    .as_ref()
                    .map(|g| g.metrics.pool_in_use(&g.host, lane.as_str()));
                if let Some(g) = &in_use {
                    g.inc();
                }
                Ok(Slot {
                    _lane: l,
                    _total: t,
                    in_use,
                })
            }
        }
    }

    /// Runs `f` on a blocking thread in `lane`: waits for a slot (past `deadline`:
    /// [`LibvirtError::Busy`]), then for the result within what is left of `deadline`
    /// (past it: [`LibvirtError::Timeout`]; the thread keeps its slot until it returns).
    pub async fn run<T, F>(
        &self,
        op: &'static str,
        lane: Lane,
        deadline: Duration,
        f: F,
    ) -> Result<T, LibvirtError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, virt::error::Error> + Send + 'static,
    {
        let started = tokio::time::Instant::now();
        let slot = self.acquire(op, lane, deadline).await?;
        let remaining = deadline.saturating_sub(started.elapsed());
        let handle = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            f()
        });
        match tokio::time::timeout(remaining, handle).await {
            Err(_) => Err(LibvirtError::Timeout {
                op,
                after: deadline,
            }),
            Ok(Ok(result)) => result.map_err(|e| LibvirtError::from_virt(op, &e)),
            Ok(Err(e)) => Err(LibvirtError::Runtime {
                op,
                reason: e.to_string(),
            }),
        }
    }

    /// Free slots of `lane` right now (tests and metrics).
    pub fn available_in(&self, lane: Lane) -> usize {
        self.lane(lane).available_permits()
    }

    /// Calls of both lanes whose threads run now (a call past its deadline included: its
    /// thread keeps its slot until it returns).
    pub fn in_flight(&self) -> usize {
        let used = |lane: Lane, limit: usize| limit.max(1).saturating_sub(self.available_in(lane));
        used(Lane::Call, self.limits.calls_per_host)
            + used(Lane::Transfer, self.limits.transfers_per_host)
    }

    /// Free ordinary-call slots right now.
    pub fn available(&self) -> usize {
        self.available_in(Lane::Call)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::error::{Classified as _, ErrorClass};

    /// Blocks a pool thread until the returned sender is used or dropped.
    fn blocker() -> (
        std::sync::mpsc::Sender<()>,
        impl FnOnce() -> Result<(), virt::error::Error>,
    ) {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        (tx, move || {
            let _ = rx.recv();
            Ok(())
        })
    }

    async fn settle(pool: &BlockingPool, lane: Lane, want: usize) {
        for _ in 0..500 {
            if pool.available_in(lane) == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{lane:?} never settled at {want}");
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_times_out_and_keeps_its_slot_until_done() {
        let pool = BlockingPool::new(2);
        let (tx, f) = blocker();
        let r = pool
            .run("stuck", Lane::Call, Duration::from_millis(50), f)
            .await;
        assert!(
            matches!(r, Err(LibvirtError::Timeout { op: "stuck", .. })),
            "{r:?}"
        );
        assert!(
            !r.as_ref().is_err_and(LibvirtError::is_link_failure),
            "a timeout alone is no evidence against the link"
        );
        assert_eq!(r.unwrap_err().class(), ErrorClass::Transient);
        // The stuck thread still holds its slot: the pool stays bounded.
        assert_eq!(pool.available(), 1);
        tx.send(()).unwrap();
        settle(&pool, Lane::Call, 2).await;
    }

    #[tokio::test]
    async fn waiting_for_a_slot_is_busy_not_a_link_failure() {
        let pool = BlockingPool::new(1);
        let (tx, f) = blocker();
        let p = pool.clone();
        let held =
            tokio::spawn(
                async move { p.run("long", Lane::Call, Duration::from_secs(60), f).await },
            );
        settle(&pool, Lane::Call, 0).await;
        let r = pool
            .run("short", Lane::Call, Duration::from_millis(50), || Ok(()))
            .await;
        let e = r.unwrap_err();
        assert!(
            matches!(
                e,
                LibvirtError::Busy {
                    op: "short",
                    lane: "call",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            !e.is_link_failure(),
            "a full pool says nothing about the link"
        );
        assert_eq!(e.class(), ErrorClass::Transient);
        tx.send(()).unwrap();
        held.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn transfers_do_not_take_the_slots_of_ordinary_calls() {
        let pool = BlockingPool::with_limits(PoolLimits {
            calls_per_host: 1,
            transfers_per_host: 1,
            total: 4,
        });
        let (tx, f) = blocker();
        let p = pool.clone();
        let upload = tokio::spawn(async move {
            p.run("upload", Lane::Transfer, Duration::from_secs(60), f)
                .await
        });
        settle(&pool, Lane::Transfer, 0).await;
        pool.run("lookup", Lane::Call, Duration::from_secs(10), || Ok(()))
            .await
            .expect("an ordinary call runs beside a transfer");
        tx.send(()).unwrap();
        upload.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn hosts_have_their_own_slots_under_one_process_bound() {
        let root = BlockingPool::with_limits(PoolLimits {
            calls_per_host: 1,
            transfers_per_host: 1,
            total: 2,
        });
        let metrics = Arc::new(CallMetrics::unregistered());
        let a = root.for_host("a", metrics.clone());
        let b = root.for_host("b", metrics.clone());
        let (tx, f) = blocker();
        let a2 = a.clone();
        let stuck = tokio::spawn(async move {
            a2.run("stuck", Lane::Call, Duration::from_secs(60), f)
                .await
        });
        settle(&a, Lane::Call, 0).await;
        assert_eq!(metrics.pool_in_use("a", "call").get(), 1);
        // Host a is full; host b is not.
        b.run("other-host", Lane::Call, Duration::from_secs(10), || Ok(()))
            .await
            .expect("another host's call is not held up by a's stuck call");
        let busy = a
            .run(
                "same-host",
                Lane::Call,
                Duration::from_millis(20),
                || Ok(()),
            )
            .await;
        assert!(matches!(busy, Err(LibvirtError::Busy { .. })), "{busy:?}");
        tx.send(()).unwrap();
        stuck.await.unwrap().unwrap();
        assert_eq!(metrics.pool_in_use("a", "call").get(), 0);
    }
}
