//! Observation of every libvirt call: one tracing span, one structured log line, and
//! Prometheus metrics (calls and errors by class, latency histogram), per host and
//! operation; and of the links under them: dials by outcome and reason, evictions by
//! cause, blocking-pool occupancy and slot waits per host and lane.
//!
//! Labels are the host name, the operation name and the outcome class only: never a URI,
//! a path, an argument or an error message, so nothing secret or high-cardinality can
//! reach a metric.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::Instrument;

use crate::error::Classified;

/// Latency buckets in seconds: local calls take a millisecond, a WAN round trip tens, a
/// slow define or start seconds; past 30 s the deadline fires anyway.
const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

/// Labels of a call counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// Host name from the config.
    pub host: String,
    /// Operation name.
    pub op: String,
    /// `ok` or the error class.
    pub outcome: String,
}

/// Labels of the latency histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    /// Host name from the config.
    pub host: String,
    /// Operation name.
    pub op: String,
}

/// Labels of the dial counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DialLabels {
    /// Host name from the config.
    pub host: String,
    /// `ok` or `error`.
    pub outcome: String,
    /// The reason code of a failed dial (`host-key`, `timeout`, ...); empty when ok.
    pub reason: String,
}

/// Labels of the eviction counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    /// Host name from the config.
    pub host: String,
    /// Why the link was dropped: `closed` (the session or connection was found dead),
    /// `transport` (a call reported a broken transport), `probe` (a liveness probe after a
    /// timeout failed).
    pub cause: String,
}

/// Labels of the liveness-probe counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    /// Host name from the config.
    pub host: String,
    /// `alive` (the link was kept) or `dead` (it was dropped).
    pub outcome: String,
}

/// Labels of the pool gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// Host name from the config.
    pub host: String,
    /// `call` or `transfer`.
    pub lane: String,
}

/// The metrics of libvirt calls and of the links they run on.
#[derive(Debug, Clone)]
pub struct CallMetrics {
    calls: Family<CallLabels, Counter>,
    latency: Family<LatencyLabels, Histogram, fn() -> Histogram>,
    dials: Family<DialLabels, Counter>,
    evictions: Family<EvictionLabels, Counter>,
    probes: Family<ProbeLabels, Counter>,
    pool_in_use: Family<PoolLabels, Gauge>,
    slot_wait: Family<PoolLabels, Histogram, fn() -> Histogram>,
}

fn new_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

impl CallMetrics {
    /// Metrics registered under `egress_libvirt_*` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::unregistered();
        registry.register(
            "egress_libvirt_calls",
            "libvirt calls by host, operation and outcome (ok or error class)",
            m.calls.clone(),
        );
        registry.register(
            "egress_libvirt_call_duration_seconds",
            "libvirt call latency by host and operation",
            m.latency.clone(),
        );
        registry.register(
            "egress_libvirt_dials",
            "SSH + libvirt dials by host, outcome and reason code",
            m.dials.clone(),
        );
        registry.register(
            "egress_libvirt_link_evictions",
            "shared links dropped, by host and cause",
            m.evictions.clone(),
        );
        registry.register(
            "egress_libvirt_link_probes",
            "liveness probes of a link after a call timed out, by host and outcome",
            m.probes.clone(),
        );
        registry.register(
            "egress_libvirt_pool_in_use",
            "blocking-pool slots held, by host and lane",
            m.pool_in_use.clone(),
        );
        registry.register(
            "egress_libvirt_pool_slot_wait_seconds",
            "time spent waiting for a blocking-pool slot, by host and lane",
            m.slot_wait.clone(),
        );
        m
    }

    /// Metrics not exposed anywhere (tests, one-shot commands).
    pub fn unregistered() -> Self {
        Self {
            calls: Family::default(),
            latency: Family::new_with_constructor(new_histogram as fn() -> Histogram),
            dials: Family::default(),
            evictions: Family::default(),
            probes: Family::default(),
            pool_in_use: Family::default(),
            slot_wait: Family::new_with_constructor(new_histogram as fn() -> Histogram),
        }
    }

    /// Counts one dial of `host`: `reason` is `None` when it succeeded.
    pub fn dialled(&self, host: &str, reason: Option<&str>) {
        self.dials
            .get_or_create(&DialLabels {
                host: host.into(),
                outcome: if reason.is_some() { "error" } else { "ok" }.into(),
                reason: reason.unwrap_or_default().into(),
            })
            .inc();
    }

    /// Dials of `host` counted so far with this outcome (`None`: successful ones).
    pub fn dials(&self, host: &str, reason: Option<&str>) -> u64 {
        self.dials
            .get_or_create(&DialLabels {
                host: host.into(),
                outcome: if reason.is_some() { "error" } else { "ok" }.into(),
                reason: reason.unwrap_or_default().into(),
            })
            .get()
    }

    /// Counts one eviction of `host`'s link.
    pub fn evicted(&self, host: &str, cause: &str) {
        self.evictions
            .get_or_create(&EvictionLabels {
                host: host.into(),
                cause: cause.into(),
            })
            .inc();
    }

    /// Evictions of `host`'s link counted so far for `cause`.
    pub fn evictions(&self, host: &str, cause: &str) -> u64 {
        self.evictions
            .get_or_create(&EvictionLabels {
                host: host.into(),
                cause: cause.into(),
            })
            .get()
    }

    /// Counts one liveness probe of `host`'s link.
    pub fn probed(&self, host: &str, alive: bool) {
        self.probes
            .get_or_create(&ProbeLabels {
                host: host.into(),
                outcome: if alive { "alive" } else { "dead" }.into(),
            })
            .inc();
    }

    /// Liveness probes of `host`'s link counted so far with this outcome.
    pub fn probes(&self, host: &str, alive: bool) -> u64 {
        self.probes
            .get_or_create(&ProbeLabels {
                host: host.into(),
                outcome: if alive { "alive" } else { "dead" }.into(),
            })
            .get()
    }

    /// The gauge of slots held in `lane` of `host`'s pool.
    pub fn pool_in_use(&self, host: &str, lane: &str) -> Gauge {
        self.pool_in_use
            .get_or_create(&PoolLabels {
                host: host.into(),
                lane: lane.into(),
            })
            .clone()
    }

    /// Records one wait for a slot in `lane` of `host`'s pool.
    pub fn observe_slot_wait(&self, host: &str, lane: &str, waited: std::time::Duration) {
        self.slot_wait
            .get_or_create(&PoolLabels {
                host: host.into(),
                lane: lane.into(),
            })
            .observe(waited.as_secs_f64());
    }

    /// Calls counted so far with these labels.
    pub fn count(&self, host: &str, op: &str, outcome: &str) -> u64 {
        self.calls
            .get_or_create(&CallLabels {
                host: host.into(),
                op: op.into(),
                outcome: outcome.into(),
            })
            .get()
    }

    /// Runs `call` inside a span, then logs and counts its outcome.
    pub async fn observe<T, E, F>(
        self: &Arc<Self>,
        host: &str,
        op: &'static str,
        call: F,
    ) -> Result<T, E>
    where
        F: Future<Output = Result<T, E>>,
        E: Classified + std::fmt::Display,
    {
        let span = tracing::debug_span!("libvirt", host, op);
        let started = Instant::now();
        let result = call.instrument(span).await;
        let elapsed = started.elapsed();
        let outcome = match &result {
            Ok(_) => "ok",
            Err(e) => e.class().as_str(),
        };
        match &result {
            Ok(_) => tracing::debug!(
                host,
                op,
                outcome,
                duration_ms = elapsed.as_millis() as u64,
                "libvirt call"
            ),
            Err(e) => {
                tracing::warn!(host, op, outcome, duration_ms = elapsed.as_millis() as u64, error = %e, "libvirt call failed")
            }
        }
        self.calls
            .get_or_create(&CallLabels {
                host: host.into(),
                op: op.into(),
                outcome: outcome.into(),
            })
            .inc();
        self.latency
            .get_or_create(&LatencyLabels {
                host: host.into(),
                op: op.into(),
            })
            .observe(elapsed.as_secs_f64());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorClass;

    #[derive(Debug)]
    struct E(ErrorClass);
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "failed")
        }
    }
    impl Classified for E {
        fn class(&self) -> ErrorClass {
            self.0
        }
    }

    #[tokio::test]
    async fn counts_by_outcome_and_exposes_no_arguments() {
        let mut registry = Registry::default();
        let m = Arc::new(CallMetrics::register(&mut registry));
        let _ = m.observe("h1", "lookup", async { Ok::<_, E>(()) }).await;
        let _ = m
            .observe("h1", "lookup", async {
                Err::<(), _>(E(ErrorClass::NotFound))
            })
            .await;
        let _ = m
            .observe("h1", "define", async {
                Err::<(), _>(E(ErrorClass::Transient))
            })
            .await;
        assert_eq!(m.count("h1", "lookup", "ok"), 1);
        assert_eq!(m.count("h1", "lookup", "not_found"), 1);
        assert_eq!(m.count("h1", "define", "transient"), 1);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("egress_libvirt_calls_total{host=\"h1\",op=\"lookup\",outcome=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("egress_libvirt_call_duration_seconds_bucket"),
            "{text}"
        );
        m.dialled("h1", None);
        m.dialled("h1", Some("host-key"));
        m.evicted("h1", "probe");
        m.probed("h1", false);
        m.pool_in_use("h1", "call").inc();
        m.observe_slot_wait("h1", "transfer", std::time::Duration::from_millis(3));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "egress_libvirt_dials_total{host=\"h1\",outcome=\"ok\",reason=\"\"} 1",
            "egress_libvirt_dials_total{host=\"h1\",outcome=\"error\",reason=\"host-key\"} 1",
            "egress_libvirt_link_evictions_total{host=\"h1\",cause=\"probe\"} 1",
            "egress_libvirt_link_probes_total{host=\"h1\",outcome=\"dead\"} 1",
            "egress_libvirt_pool_in_use{host=\"h1\",lane=\"call\"} 1",
            "egress_libvirt_pool_slot_wait_seconds_count{host=\"h1\",lane=\"transfer\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
