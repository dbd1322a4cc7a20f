//! Loads the template plugins in the background, after the HTTP endpoints are up.
//!
//! A plugin given by `url` is downloaded at start; the server may be down, slow or not
//! reachable yet (DNS, a proxy coming up). That must neither crash-loop the operator nor
//! keep it from serving its probes, so the run mode starts with every plugin *loading*
//! ([`TemplateSet::loading`]) and this loader fills the slots:
//!
//! - a failure whose class is transient (see [`TemplateError`]'s `Classified`: every
//!   download failure, since a URL can start answering without any config change, and a
//!   local file that cannot be read for a reason other than "not found") is retried with
//!   capped exponential backoff and jitter, for as long as the process runs; the plugin
//!   stays *loading* with the last failure as its reason, and a Create that needs it fails
//!   transiently ("plugins loading") and is requeued;
//! - a permanent failure (the bytes arrived but their sha256 differs from the config, the
//!   component is invalid or imports what the sandbox forbids, the settings are refused,
//!   a local file is missing) is not retried: the same config fails the same way. The
//!   plugin is *failed* with its reason until the config is fixed and the pod restarted;
//! - a success installs the plugin in place: the provider sees it on its next render, no
//!   restart.
//!
//! Each attempt is reported in metrics (`egress_template_plugin_up{kind,plugin}`,
//! `egress_template_plugin_load_attempts_total{kind,outcome}`); the states are read by
//! `/readyz` and the `ProviderHealth` status from the set itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::config::TemplatesConfig;
use crate::controller::requeue::{Ladder, random_unit};
use crate::error::{Classified, ErrorClass};
use crate::templates::{
    TemplateEngine, TemplateError, TemplateErrorKind, TemplateKind, TemplateSet,
};

/// When to try a transiently failed plugin load again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadBackoff {
    /// `base * 2^n`, capped.
    pub ladder: Ladder,
    /// +/- this fraction of each delay, so replicas started together do not download in
    /// lockstep.
    pub jitter: f64,
}

impl Default for LoadBackoff {
    /// The first retry after a second (a network or a sidecar still coming up), doubling
    /// to at most five minutes: a server that comes back after a long outage is noticed
    /// within minutes, and one that stays down sees a request every few minutes per
    /// replica, not a flood.
    fn default() -> Self {
        Self {
            ladder: Ladder {
                base: Duration::from_secs(1),
                max: Duration::from_secs(300),
            },
            jitter: 0.2,
        }
    }
}

impl LoadBackoff {
    /// The wait after the `failures`-th consecutive transient failure (0 = the first);
    /// `unit` in [0, 1) picks the point in the jitter band (0.5: the ladder's delay).
    pub fn delay(&self, failures: u32, unit: f64) -> Duration {
        let d = self.ladder.delay(failures).as_secs_f64();
        let spread = self.jitter.clamp(0.0, 1.0) * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
        Duration::from_secs_f64(d * (1.0 + spread))
    }
}

/// Labels of the per-plugin gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    /// `domain` or `vendor-data`.
    pub kind: String,
    /// `<kind>:<path or url>`.
    pub plugin: String,
}

/// Labels of the attempt counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    /// `domain` or `vendor-data`.
    pub kind: String,
    /// `ok`, `transient` (retried) or `permanent` (given up).
    pub outcome: String,
}

/// Metrics of plugin loading.
#[derive(Debug, Clone, Default)]
pub struct PluginMetrics {
    up: Family<PluginLabels, Gauge>,
    attempts: Family<AttemptLabels, Counter>,
}

impl PluginMetrics {
    /// Metrics registered under `egress_template_plugin_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_template_plugin_up",
            "1 when the template plugin is loaded and usable, else 0 (loading or failed)",
            m.up.clone(),
        );
        registry.register(
            "egress_template_plugin_load_attempts",
            "template plugin load attempts by outcome (ok, transient: retried, permanent: given up)",
            m.attempts.clone(),
        );
        m
    }

    /// The up gauge of a plugin (tests).
    pub fn up(&self, kind: TemplateKind, plugin: &str) -> i64 {
        self.up.get_or_create(&plugin_labels(kind, plugin)).get()
    }

    /// Attempts of a kind with that outcome (tests).
    pub fn attempts(&self, kind: TemplateKind, outcome: &str) -> u64 {
        self.attempts
            .get_or_create(&AttemptLabels {
                kind: kind.as_str().into(),
                outcome: outcome.into(),
            })
            .get()
    }

    fn set_up(&self, kind: TemplateKind, plugin: &str, up: bool) {
        self.up
            .get_or_create(&plugin_labels(kind, plugin))
            .set(i64::from(up));
    }

    fn count(&self, kind: TemplateKind, outcome: &str) {
        self.attempts
            .get_or_create(&AttemptLabels {
                kind: kind.as_str().into(),
                outcome: outcome.into(),
            })
            .inc();
    }
}

fn plugin_labels(kind: TemplateKind, plugin: &str) -> PluginLabels {
    PluginLabels {
        kind: kind.as_str().into(),
        plugin: plugin.into(),
    }
}

/// How loading one plugin ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadEnd {
    /// Loaded and installed.
    Loaded,
    /// Failed permanently; not retried.
    Failed,
    /// Shutdown came first.
    Stopped,
}

/// Fills a [`TemplateSet`] made with [`TemplateSet::loading`].
pub struct PluginLoader {
    set: Arc<TemplateSet>,
    engine: Arc<TemplateEngine>,
    templates: TemplatesConfig,
    backoff: LoadBackoff,
    metrics: PluginMetrics,
}

impl std::fmt::Debug for PluginLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginLoader")
            .field("backoff", &self.backoff)
            .finish_non_exhaustive()
    }
}

impl PluginLoader {
    /// A loader of `templates` into `set`, with `engine`.
    pub fn new(
        set: Arc<TemplateSet>,
        engine: Arc<TemplateEngine>,
        templates: TemplatesConfig,
        backoff: LoadBackoff,
        metrics: PluginMetrics,
    ) -> Self {
        Self {
            set,
            engine,
            templates,
            backoff,
            metrics,
        }
    }

    /// Loads both plugins concurrently, each retried until it loads or fails for good, or
    /// until `stop` resolves. A load in progress at `stop` runs on in its blocking thread
    /// (a download is bounded by its own timeout) and is simply not waited for.
    pub async fn run(self, stop: impl Future<Output = ()> + Send) -> [LoadEnd; 2] {
        let stop = futures_util::FutureExt::shared(Box::pin(stop));
        let one = |kind: TemplateKind| {
            let t = match kind {
                TemplateKind::Domain => self.templates.domain.clone(),
                TemplateKind::VendorData => self.templates.vendor_data.clone(),
            };
            let plugin = self
                .set
                .health()
                .into_iter()
                .find(|h| h.kind == kind)
                .map(|h| h.plugin)
                .unwrap_or_else(|| kind.as_str().to_string());
            let (set, engine, name) = (self.set.clone(), self.engine.clone(), plugin.clone());
            let attempt = move || {
                let (set, engine, t, plugin) =
                    (set.clone(), engine.clone(), t.clone(), name.clone());
                async move {
                    tokio::task::spawn_blocking(move || set.load_one(&engine, kind, &t))
                        .await
                        .unwrap_or_else(|e| {
                            Err(TemplateError {
                                plugin,
                                kind: TemplateErrorKind::Engine(format!(
                                    "the load task failed: {e}"
                                )),
                            })
                        })
                }
            };
            retry(
                kind,
                plugin,
                attempt,
                &self.set,
                self.backoff,
                random_unit,
                &self.metrics,
                stop.clone(),
            )
        };
        let (domain, vendor_data) =
            tokio::join!(one(TemplateKind::Domain), one(TemplateKind::VendorData));
        [domain, vendor_data]
    }
}

/// Runs `attempt` until it succeeds, fails permanently, or `stop` resolves; records each
/// failure on `set` and in `metrics`, and waits [`LoadBackoff::delay`] (jittered by
/// `jitter`, a number in [0, 1)) after each transient one.
#[allow(clippy::too_many_arguments)]
pub async fn retry<F, Fut>(
    kind: TemplateKind,
    plugin: String,
    mut attempt: F,
    set: &TemplateSet,
    backoff: LoadBackoff,
    jitter: fn() -> f64,
    metrics: &PluginMetrics,
    stop: impl Future<Output = ()>,
) -> LoadEnd
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), TemplateError>>,
{
    let mut stop = std::pin::pin!(stop);
    metrics.set_up(kind, &plugin, false);
    let mut failures: u32 = 0;
    loop {
        let result = tokio::select! {
            biased;
            () = &mut stop => return LoadEnd::Stopped,
            r = attempt() => r,
        };
        let e = match result {
            Ok(()) => {
                metrics.count(kind, "ok");
                metrics.set_up(kind, &plugin, true);
                if failures > 0 {
                    tracing::info!(%plugin, failures, "template plugin loaded after retries");
                }
                return LoadEnd::Loaded;
            }
            Err(e) => e,
        };
        if e.class() != ErrorClass::Transient {
            metrics.count(kind, "permanent");
            set.mark_failed(kind, &e, false);
            return LoadEnd::Failed;
        }
        metrics.count(kind, "transient");
        set.mark_failed(kind, &e, true);
        let wait = backoff.delay(failures, jitter());
        failures = failures.saturating_add(1);
        tracing::info!(%plugin, attempt = failures, retry_in = ?wait, "retrying the template plugin load");
        tokio::select! {
            biased;
            () = &mut stop => return LoadEnd::Stopped,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::time::Instant;

    fn templates(domain: &str, vendor: &str) -> TemplatesConfig {
        serde_json::from_value(serde_json::json!({
            "domain": { "url": domain, "sha256": "ab".repeat(32) },
            "vendorData": { "path": vendor },
        }))
        .unwrap()
    }

    fn refused(url: &str) -> TemplateError {
        TemplateError {
            plugin: format!("domain:{url}"),
            kind: TemplateErrorKind::Download {
                url: url.into(),
                reason: "Connection refused".into(),
            },
        }
    }

    fn mismatch(url: &str) -> TemplateError {
        TemplateError {
            plugin: format!("domain:{url}"),
            kind: TemplateErrorKind::Sha256Mismatch {
                expected: "ab".repeat(32),
                actual: "cd".repeat(32),
            },
        }
    }

    const URL: &str = "https://127.0.0.1:1/d.wasm";
    /// Jitter fixed at the middle of the band: delays are exactly the ladder's.
    fn middle() -> f64 {
        0.5
    }

    #[test]
    fn backoff_doubles_is_capped_and_jitter_stays_in_its_band() {
        let b = LoadBackoff::default();
        let secs = |n| b.delay(n, 0.5).as_secs_f64();
        assert_eq!(
            (0..6).map(secs).collect::<Vec<_>>(),
            vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
        );
        assert_eq!(secs(9), 300.0);
        assert_eq!(secs(1000), 300.0);
        assert_eq!(b.delay(3, 0.0).as_secs_f64(), 8.0 * 0.8);
        assert_eq!(b.delay(3, 1.0).as_secs_f64(), 8.0 * 1.2);
        assert_eq!(b.delay(20, 1.0).as_secs_f64(), 300.0 * 1.2);
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_on_the_ladder_until_the_load_succeeds() {
        let set = TemplateSet::loading(&templates(URL, "/p/v.wasm"));
        let metrics = PluginMetrics::default();
        let start = Instant::now();
        let times = Mutex::new(Vec::new());
        let states = Mutex::new(Vec::new());
        let calls = AtomicU32::new(0);
        let plugin = format!("domain:{URL}");
        let end = retry(
            TemplateKind::Domain,
            plugin.clone(),
            || {
                times.lock().unwrap().push(start.elapsed());
                states.lock().unwrap().push(set.health()[0].clone());
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move { if n < 5 { Err(refused(URL)) } else { Ok(()) } }
            },
            &set,
            LoadBackoff::default(),
            middle,
            &metrics,
            std::future::pending(),
        )
        .await;
        assert_eq!(end, LoadEnd::Loaded);
        // Attempts at 0, then 1, 2, 4, 8, 16 s apart (virtual time).
        let secs: Vec<u64> = times.lock().unwrap().iter().map(|d| d.as_secs()).collect();
        assert_eq!(secs, vec![0, 1, 3, 7, 15, 31]);
        // Before the first attempt: not loaded yet; after a failure: loading with it.
        let states = states.lock().unwrap();
        assert_eq!(
            states[0].problem.as_deref(),
            Some("no load attempt has finished yet")
        );
        assert!(states[1..].iter().all(|h| h.loading
            && h.problem.as_deref()
                == Some("cannot download https://127.0.0.1:1/d.wasm: Connection refused")));
        assert_eq!(metrics.attempts(TemplateKind::Domain, "transient"), 5);
        assert_eq!(metrics.attempts(TemplateKind::Domain, "ok"), 1);
        assert_eq!(metrics.up(TemplateKind::Domain, &plugin), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_failure_is_not_retried_and_stays_with_its_reason() {
        let set = TemplateSet::loading(&templates(URL, "/p/v.wasm"));
        let metrics = PluginMetrics::default();
        let calls = AtomicU32::new(0);
        let end = retry(
            TemplateKind::Domain,
            format!("domain:{URL}"),
            || {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move { Err(if n == 0 { refused(URL) } else { mismatch(URL) }) }
            },
            &set,
            LoadBackoff::default(),
            middle,
            &metrics,
            std::future::pending(),
        )
        .await;
        assert_eq!(end, LoadEnd::Failed);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let h = &set.health()[0];
        assert_eq!(h.state(), "failed");
        assert!(h.problem.as_deref().unwrap().contains("sha256 mismatch"));
        assert_eq!(
            set.domain().unwrap_err().class(),
            crate::ErrorClass::Permanent
        );
        assert_eq!(metrics.attempts(TemplateKind::Domain, "permanent"), 1);
        assert_eq!(
            metrics.up(TemplateKind::Domain, &format!("domain:{URL}")),
            0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stop_ends_the_wait_between_attempts() {
        let set = TemplateSet::loading(&templates(URL, "/p/v.wasm"));
        let metrics = PluginMetrics::default();
        let calls = AtomicU32::new(0);
        let start = Instant::now();
        let end = retry(
            TemplateKind::Domain,
            format!("domain:{URL}"),
            || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { Err(refused(URL)) }
            },
            &set,
            LoadBackoff::default(),
            middle,
            &metrics,
            tokio::time::sleep(Duration::from_secs(100)),
        )
        .await;
        assert_eq!(end, LoadEnd::Stopped);
        // Attempts at 0, 1, 3, 7, 15, 31, 63 s; the next would be at 127 s.
        assert_eq!(calls.load(Ordering::SeqCst), 7);
        assert_eq!(start.elapsed(), Duration::from_secs(100));
        assert_eq!(set.health()[0].state(), "loading");
    }

    /// The whole loader over the real engine: a missing local file is permanent, and
    /// the other plugin still loads.
    #[tokio::test(start_paused = true)]
    async fn the_loader_loads_what_it_can_and_reports_the_rest() {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target")
            });
        let vendor = target.join("plugins/vendor-data-default.wasm");
        assert!(vendor.exists(), "run `make plugins` first");
        let config: TemplatesConfig = serde_json::from_value(serde_json::json!({
            "domain": { "path": "/nonexistent/domain.wasm" },
            "vendorData": { "path": vendor },
        }))
        .unwrap();
        let set = Arc::new(TemplateSet::loading(&config));
        let metrics = PluginMetrics::default();
        let loader = PluginLoader::new(
            set.clone(),
            Arc::new(TemplateEngine::new(None).unwrap()),
            config,
            LoadBackoff::default(),
            metrics.clone(),
        );
        let ends = loader.run(std::future::pending()).await;
        assert_eq!(ends, [LoadEnd::Failed, LoadEnd::Loaded]);
        let health = set.health();
        assert_eq!((health[0].state(), health[1].state()), ("failed", "loaded"));
        assert!(set.vendor_data().is_ok());
        assert_eq!(metrics.up(TemplateKind::VendorData, &health[1].plugin), 1);
    }
}
