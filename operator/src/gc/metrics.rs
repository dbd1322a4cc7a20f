//! The collector's metrics (`egress_gc_*`).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::report::GcReport;
use super::volumes::{VolumeKeep, VolumeKind};
use crate::error::Classified;

/// Labels: sweep result (`ok`, `partial`, `skipped`, `interrupted`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepLabels {
    /// Result.
    pub result: String,
}

/// Labels: provider.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabel {
    /// Provider name.
    pub provider: String,
}

/// Labels: provider and orphan reason (`no-proxy`, `duplicate`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OrphanLabels {
    /// Provider name.
    pub provider: String,
    /// Reason.
    pub reason: String,
}

/// Labels: provider and delete outcome (`ok` or the error class).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeleteLabels {
    /// Provider name.
    pub provider: String,
    /// Outcome.
    pub outcome: String,
}

/// Labels: provider and target.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
}

/// Garbage collector metrics.
#[derive(Debug, Clone, Default)]
pub struct GcMetrics {
    sweeps: Family<SweepLabels, Counter>,
    seen: Family<ProviderLabel, Counter>,
    orphans: Family<OrphanLabels, Counter>,
    deletes: Family<DeleteLabels, Counter>,
    skipped: Family<TargetLabels, Counter>,
    last_sweep_timestamp: Gauge<f64, AtomicU64>,
    last_sweep_duration: Gauge<f64, AtomicU64>,
    unconfigured: Family<HostLabel, Gauge>,
    volume_candidates: Family<VolumeLabels, Counter>,
    volume_deletes: Family<VolumeDeleteLabels, Counter>,
    volume_skipped: Family<TargetLabels, Counter>,
    /// Hosts the gauge above was last set for, so a host that no longer has any is set
    /// back to zero instead of keeping its last count.
    unconfigured_hosts: Arc<Mutex<std::collections::BTreeSet<String>>>,
}

/// Labels: provider and volume kind (`instance`, `staging`, `unused-image`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeLabels {
    /// Provider name.
    pub provider: String,
    /// Kind.
    pub kind: String,
}

/// Labels: provider, volume kind and delete outcome (`ok`, `changed` or the error class).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeDeleteLabels {
    /// Provider name.
    pub provider: String,
    /// Kind.
    pub kind: String,
    /// Outcome.
    pub outcome: String,
}

/// Labels: a host name.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HostLabel {
    /// Host name.
    pub host: String,
}

impl GcMetrics {
    /// Metrics registered under `egress_gc_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_gc_sweeps",
            "garbage collection sweeps by result (ok, partial, skipped, interrupted)",
            m.sweeps.clone(),
        );
        registry.register(
            "egress_gc_instances_seen",
            "instances listed by garbage collection sweeps, by provider",
            m.seen.clone(),
        );
        registry.register(
            "egress_gc_orphans",
            "instances past the grace period found to be collected, by provider and reason",
            m.orphans.clone(),
        );
        registry.register(
            "egress_gc_deletes",
            "deletes by the garbage collector, by provider and outcome (ok or error class)",
            m.deletes.clone(),
        );
        registry.register(
            "egress_gc_targets_skipped",
            "targets skipped by a sweep because their listing failed",
            m.skipped.clone(),
        );
        registry.register(
            "egress_gc_last_sweep_timestamp_seconds",
            "when the last sweep that ran to its end finished (Unix time)",
            m.last_sweep_timestamp.clone(),
        );
        registry.register(
            "egress_gc_volume_candidates",
            "leftover volume groups listed by sweeps, by provider and kind (instance, \
             staging, unused-image)",
            m.volume_candidates.clone(),
        );
        registry.register(
            "egress_gc_volume_deletes",
            "leftover volume groups deleted by the collector, by provider, kind and outcome \
             (ok, changed, or the error class)",
            m.volume_deletes.clone(),
        );
        registry.register(
            "egress_gc_volume_targets_skipped",
            "targets whose leftover volumes a sweep skipped because their listing failed",
            m.volume_skipped.clone(),
        );
        registry.register(
            "egress_gc_unconfigured_host_instances",
            "instances Proxies name on a host that is not in the config any more (abandoned \
             there: neither watched nor collected), by host, as of the last sweep",
            m.unconfigured.clone(),
        );
        registry.register(
            "egress_gc_last_sweep_duration_seconds",
            "how long the last sweep that ran to its end took",
            m.last_sweep_duration.clone(),
        );
        m
    }

    /// Sweeps counted with this result (for tests).
    pub fn sweeps(&self, result: &str) -> u64 {
        self.sweeps
            .get_or_create(&SweepLabels {
                result: result.into(),
            })
            .get()
    }

    /// Deletes counted with this outcome (for tests).
    pub fn deletes(&self, provider: &str, outcome: &str) -> u64 {
        self.deletes
            .get_or_create(&DeleteLabels {
                provider: provider.into(),
                outcome: outcome.into(),
            })
            .get()
    }

    /// Leftover volume groups deleted with this outcome (for tests).
    pub fn volume_deletes(&self, provider: &str, kind: VolumeKind, outcome: &str) -> u64 {
        self.volume_deletes
            .get_or_create(&VolumeDeleteLabels {
                provider: provider.into(),
                kind: kind.as_str().into(),
                outcome: outcome.into(),
            })
            .get()
    }

    /// Instances Proxies name on the unconfigured host `host`, as of the last sweep.
    pub fn unconfigured(&self, host: &str) -> i64 {
        self.unconfigured
            .get_or_create(&HostLabel { host: host.into() })
            .get()
    }

    pub(super) fn record(&self, report: &GcReport, finished: Timestamp, took: Duration) {
        if report.owners_error.is_none() {
            let mut counts: std::collections::BTreeMap<&str, i64> = Default::default();
            for u in &report.unconfigured {
                *counts.entry(u.instance.host.as_str()).or_default() += 1;
            }
            let mut last = match self.unconfigured_hosts.lock() {
                Ok(l) => l,
                Err(p) => p.into_inner(),
            };
            for host in last.iter() {
                if !counts.contains_key(host.as_str()) {
                    self.unconfigured
                        .get_or_create(&HostLabel { host: host.clone() })
                        .set(0);
                }
            }
            for (host, n) in &counts {
                self.unconfigured
                    .get_or_create(&HostLabel {
                        host: (*host).to_string(),
                    })
                    .set(*n);
            }
            *last = counts.keys().map(|h| (*h).to_string()).collect();
        }
        self.sweeps
            .get_or_create(&SweepLabels {
                result: report.result().into(),
            })
            .inc();
        for s in &report.seen {
            self.seen
                .get_or_create(&ProviderLabel {
                    provider: s.provider.clone(),
                })
                .inc();
        }
        for t in &report.skipped_targets {
            self.skipped
                .get_or_create(&TargetLabels {
                    provider: t.provider.clone(),
                    target: t.target.clone(),
                })
                .inc();
        }
        let judged = report
            .deleted
            .iter()
            .map(|d| (&d.instance, &d.reason, "ok"))
            .chain(
                report
                    .failed
                    .iter()
                    .map(|f| (&f.instance, &f.reason, f.error.class().as_str())),
            );
        for (instance, reason, outcome) in judged {
            self.orphans
                .get_or_create(&OrphanLabels {
                    provider: instance.provider.clone(),
                    reason: reason.as_str().into(),
                })
                .inc();
            self.deletes
                .get_or_create(&DeleteLabels {
                    provider: instance.provider.clone(),
                    outcome: outcome.into(),
                })
                .inc();
        }
        let volumes =
            report
                .volumes_deleted
                .iter()
                .map(|v| (v, "ok"))
                .chain(report.volumes_kept.iter().filter_map(|(v, k)| {
                    matches!(k, VolumeKeep::Changed(_)).then_some((v, "changed"))
                }))
                .chain(
                    report
                        .volumes_failed
                        .iter()
                        .map(|(v, e)| (v, e.class().as_str())),
                );
        for (v, outcome) in volumes {
            self.volume_deletes
                .get_or_create(&VolumeDeleteLabels {
                    provider: v.provider.clone(),
                    kind: v.kind.as_str().into(),
                    outcome: outcome.into(),
                })
                .inc();
        }
        for v in report
            .volumes_deleted
            .iter()
            .chain(report.volumes_kept.iter().map(|(v, _)| v))
            .chain(report.volumes_failed.iter().map(|(v, _)| v))
        {
            self.volume_candidates
                .get_or_create(&VolumeLabels {
                    provider: v.provider.clone(),
                    kind: v.kind.as_str().into(),
                })
                .inc();
        }
        for t in &report.volume_targets_skipped {
            self.volume_skipped
                .get_or_create(&TargetLabels {
                    provider: t.provider.clone(),
                    target: t.target.clone(),
                })
                .inc();
        }
        if report.owners_error.is_none() && !report.interrupted {
            self.last_sweep_timestamp
                .set(finished.as_millisecond() as f64 / 1000.0);
            self.last_sweep_duration.set(took.as_secs_f64());
        }
    }
}
