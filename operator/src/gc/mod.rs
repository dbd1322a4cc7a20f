//! The garbage collector: one sweep loop ([`GarbageCollector::run`]) over three
//! collectors, one file each by what it collects:
//!
//! - [`domains`]: instances (domains) no Proxy owns any more, and duplicates a Proxy no
//!   longer names;
//! - [`volumes`]: leftover instance volumes (root and seed) with no domain;
//! - [`images`]: staging volumes and retired base images.
//!
//! A sweep runs them in that order with one listing of the Proxies ([`ProxyIndex`],
//! in [`index`]); what it saw and did is a [`GcReport`] ([`report`]) and metrics
//! ([`metrics`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};

use crate::config::{GcConfig, RetiredImagesPolicy};
use crate::error::{Classified, ErrorClass};
use crate::provider::{InstanceId, ProviderError, SharedProvider};

pub mod domains;
pub mod events;
pub mod images;
pub mod index;
pub mod metrics;
pub mod report;
pub mod volumes;

pub use index::{FakeProxyIndex, KubeProxyIndex, Owner, ProxyIndex};
pub use metrics::*;
pub use report::*;
pub use volumes::*;

/// A collector failure.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// The Proxies could not be listed; the sweep deletes nothing.
    #[error("listing Proxies failed: {source}")]
    ListProxies {
        /// Class of the failure.
        class: ErrorClass,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Deleting a group of leftover volumes failed; the sweep goes on with the next.
    #[error("deleting volumes {key:?} on {target:?} of provider {provider:?} failed: {source}")]
    DeleteVolumes {
        /// Provider name.
        provider: String,
        /// Target (host).
        target: String,
        /// The candidate's key.
        key: String,
        /// What the provider said.
        #[source]
        source: ProviderError,
    },
    /// A delete failed; the sweep goes on with the next instance.
    #[error("deleting instance {instance} of provider {provider:?} failed: {source}")]
    Delete {
        /// Provider name.
        provider: String,
        /// The instance.
        instance: InstanceId,
        /// What the provider said.
        #[source]
        source: ProviderError,
    },
}

impl Classified for GcError {
    fn class(&self) -> ErrorClass {
        match self {
            GcError::ListProxies { class, .. } => *class,
            GcError::Delete { source, .. } | GcError::DeleteVolumes { source, .. } => {
                source.class()
            }
        }
    }
}

/// Lets [`GarbageCollector::run`] stop a sweep between deletes, and tells it whether a
/// delete is in flight (then it waits for it instead of dropping it half-way).
#[derive(Debug, Default)]
struct SweepControl {
    stop: AtomicBool,
    in_delete: AtomicBool,
}

/// Where "now" comes from; injectable so the grace period is tested without sleeping.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// Sweeps every provider for instances to collect.
pub struct GarbageCollector {
    providers: Vec<SharedProvider>,
    index: Arc<dyn ProxyIndex>,
    period: Duration,
    grace: SignedDuration,
    metrics: GcMetrics,
    clock: Clock,
    volumes: Vec<Arc<dyn VolumeCollector>>,
    retired: RetiredImagesPolicy,
    /// When each leftover volume group was first seen, by provider, target and key.
    first_seen: Mutex<HashMap<(String, String, String), Timestamp>>,
    /// Where hosts refused for good are reported; none in tests that do not look.
    events: Option<Arc<dyn events::GcEvents>>,
}

impl std::fmt::Debug for GarbageCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let providers: Vec<&str> = self.providers.iter().map(|p| p.name()).collect();
        f.debug_struct("GarbageCollector")
            .field("providers", &providers)
            .field("period", &self.period)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl GarbageCollector {
    /// A collector over `providers`, with period and grace period from `config`.
    pub fn new(
        providers: Vec<SharedProvider>,
        index: Arc<dyn ProxyIndex>,
        config: &GcConfig,
        metrics: GcMetrics,
    ) -> Self {
        Self {
            providers,
            index,
            // A zero period would make `tokio::time::interval` panic; the schema forbids
            // it, this keeps a hand-built config from crashing the operator.
            period: Duration::from_secs(u64::from(config.period_seconds.max(1))),
            grace: SignedDuration::from_secs(i64::from(config.grace_period_seconds)),
            metrics,
            clock: Arc::new(Timestamp::now),
            volumes: Vec::new(),
            retired: config.retired_images.clone(),
            first_seen: Mutex::new(HashMap::new()),
            events: None,
        }
    }

    /// Reports hosts refused for a permanent reason as events.
    pub fn with_events(mut self, events: Arc<dyn events::GcEvents>) -> Self {
        self.events = Some(events);
        self
    }

    /// Also sweeps the leftover volumes of these providers.
    pub fn with_volumes(mut self, collectors: Vec<Arc<dyn VolumeCollector>>) -> Self {
        self.volumes = collectors;
        self
    }

    /// Replaces the clock (tests).
    pub fn with_clock(mut self, clock: impl Fn() -> Timestamp + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The metrics.
    pub fn metrics(&self) -> &GcMetrics {
        &self.metrics
    }

    /// One sweep at the clock's "now".
    pub async fn sweep_once(&self) -> GcReport {
        self.sweep(&SweepControl::default()).await
    }

    async fn sweep(&self, ctl: &SweepControl) -> GcReport {
        let started = Instant::now();
        let now = (self.clock)();
        let mut report = GcReport::default();
        // Domains first, then the volumes they leave behind (instance volumes and
        // images): one pass, one owner set.
        if let Some(owners) = self.sweep_domains(ctl, now, &mut report).await
            && !report.interrupted
        {
            self.sweep_volumes(ctl, &owners, now, &mut report).await;
        }
        self.finish(&report, started);
        if let Some(events) = &self.events {
            for (provider, hosts) in events::refused_hosts(&report) {
                events.refused(&provider, &hosts).await;
            }
        }
        report
    }

    fn finish(&self, report: &GcReport, started: Instant) {
        let took = started.elapsed();
        self.metrics.record(report, Timestamp::now(), took);
        tracing::info!(
            result = report.result(),
            seen = report.seen.len(),
            kept = report.kept.len(),
            deleted = report.deleted.len(),
            failed = report.failed.len(),
            skipped_targets = report.skipped_targets.len(),
            duration_ms = took.as_millis() as u64,
            "gc: sweep done"
        );
    }

    /// Sweeps every period until `shutdown` completes. On shutdown a sweep stops at once,
    /// except that a delete in flight is finished (a half-done delete would leave
    /// volumes behind until the next sweep).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut ticks = tokio::time::interval(self.period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            period_s = self.period.as_secs(),
            grace_s = self.grace.as_secs(),
            "gc: started"
        );
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = ticks.tick() => {}
            }
            let ctl = SweepControl::default();
            let mut sweep = std::pin::pin!(self.sweep(&ctl));
            let stopped = tokio::select! {
                biased;
                _ = &mut sweep => false,
                () = &mut shutdown => true,
            };
            if stopped {
                ctl.stop.store(true, Ordering::SeqCst);
                if ctl.in_delete.load(Ordering::SeqCst) {
                    let _ = sweep.await;
                }
                break;
            }
        }
        tracing::info!("gc: stopped");
    }
}

#[cfg(test)]
mod tests;
