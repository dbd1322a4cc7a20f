//! Live config: the operator watches its config file and installs a new config that passes
//! every check, without a restart (issue 30, item 2).
//!
//! The file is read every [`PERIOD`] and compared by content, not by modification time or
//! inotify: a ConfigMap volume changes through a symlink swap (`..data`), which an inotify
//! watch on the file itself misses and which may keep the old mtime. A new content is
//! checked exactly as at start ([`crate::config::load_file`]), then for fields that take
//! effect only at start ([`needs_restart`]), then its plugins are loaded and checked (off
//! the async threads: compiling and a download block). Any failure refuses the whole
//! config and the running one stays; the refusal is shown on `/readyz`, in
//! `egress_config_reloads_total{result="refused"}` and `egress_config_reload_refused`, in a
//! log line, and as a Warning event on the provider's ProviderHealth object. A refused
//! content is not tried again until the file changes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sha2::{Digest, Sha256};

use crate::config::live::{Live, needs_restart};
use crate::templates::{TemplateEngine, TemplateSet};

/// How often the file is read.
pub const PERIOD: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

/// `egress_config_reload*` metrics.
#[derive(Clone, Debug, Default)]
pub struct ReloadMetrics {
    reloads: Family<ResultLabels, Counter>,
    refused: Gauge,
    generation: Gauge,
}

impl ReloadMetrics {
    /// Registers the metrics.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_config_reloads",
            "config file changes seen, by result (installed, refused)",
            m.reloads.clone(),
        );
        registry.register(
            "egress_config_reload_refused",
            "1 while the config file holds a config that was refused (the previous one runs)",
            m.refused.clone(),
        );
        registry.register(
            "egress_config_generation",
            "how many reloads installed a config since start",
            m.generation.clone(),
        );
        m
    }
}

/// The last refusal, for `/readyz`: `None` while the file's config is the one in force.
#[derive(Debug, Default)]
pub struct ReloadState(std::sync::Mutex<Option<String>>);

impl ReloadState {
    /// The `/readyz` line.
    pub fn report(&self) -> String {
        match &*self.0.lock().unwrap_or_else(|p| p.into_inner()) {
            None => "config: ok\n".into(),
            Some(why) => format!(
                "config: reload refused, the previous config runs: {}\n",
                why.replace(['\r', '\n'], " ")
            ),
        }
    }

    fn set(&self, why: Option<String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }
}

/// Watches the config file and installs what passes.
pub struct Reloader {
    path: PathBuf,
    live: Arc<Live>,
    engine: Arc<TemplateEngine>,
    state: Arc<ReloadState>,
    metrics: ReloadMetrics,
    events: Option<(Recorder, String)>,
    seen: [u8; 32],
}

/// Why a reload was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It fails a check that start-up also makes.
    #[error("{0}")]
    Invalid(String),
    /// It changes fields read only at start.
    #[error("{} changed; these take effect only at start: restart the operator to apply them", .0.join(", "))]
    NeedsRestart(Vec<String>),
    /// A plugin did not load or was refused.
    #[error("plugin refused: {0}")]
    Plugin(String),
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("path", &self.path)
            .field("seen", &hex::encode(self.seen))
            .finish_non_exhaustive()
    }
}

impl crate::error::Classified for Refused {
    fn class(&self) -> crate::error::ErrorClass {
        match self {
            // A file being written (a partial ConfigMap swap cannot happen, a hand edit
            // can): read again at the next change.
            Refused::Read { .. } => crate::error::ErrorClass::Transient,
            _ => crate::error::ErrorClass::Permanent,
        }
    }
}

impl Reloader {
    /// Watches `path`, whose config is in force in `live`. Its first look reads the file
    /// and finds the same config (the bytes are not known to be the ones loaded at start:
    /// the file may have changed in between), which changes nothing.
    pub fn new(
        path: PathBuf,
        live: Arc<Live>,
        engine: Arc<TemplateEngine>,
        state: Arc<ReloadState>,
        metrics: ReloadMetrics,
    ) -> Self {
        Self {
            path,
            live,
            engine,
            state,
            metrics,
            events: None,
            seen: [0; 32],
        }
    }

    /// Also publishes each outcome as an event on the ProviderHealth object `provider`
    /// (the leader sets this for its term: one replica tells, once).
    pub fn set_events(&mut self, client: kube::Client, instance: String, provider: &str) {
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: "egress-operator".into(),
                instance: Some(instance),
            },
        );
        self.events = Some((recorder, provider.to_string()));
    }

    /// Reads the file every [`PERIOD`] until `stop` resolves.
    pub async fn run(&mut self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(PERIOD) => {}
            }
            self.look().await;
        }
    }

    /// One look at the file: installs or refuses a changed content; `None` when the
    /// content, or the config it holds, is the one in force (a comment edited, the first
    /// look of a term).
    pub async fn look(&mut self) -> Option<Result<u64, String>> {
        let bytes = match tokio::fs::read(&self.path).await {
            Ok(b) => b,
            Err(source) => {
                // Mid-swap, or removed: the running config stays; the next look reads
                // the file again.
                let e = Refused::Read {
                    path: self.path.display().to_string(),
                    source,
                };
                tracing::debug!(error = %e, "config file not readable; the running config stays");
                return None;
            }
        };
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        if digest == self.seen {
            return None;
        }
        self.seen = digest;
        let outcome = match self.check_and_install().await {
            Ok(None) => {
                // The config in force: a refusal before it no longer stands.
                self.metrics.refused.set(0);
                self.state.set(None);
                return None;
            }
            Ok(Some(generation)) => Ok(generation),
            Err(e) => Err(e),
        };
        let mut why = None;
        let (result, note, type_) = match &outcome {
            Ok(generation) => (
                "installed",
                format!(
                    "config {} reloaded (generation {generation}); proxies made from older \
                     inputs show UpToDate=False",
                    self.path.display()
                ),
                EventType::Normal,
            ),
            Err(e) => {
                let short = crate::controller::event_note(e.to_string());
                let note = format!(
                    "config {} refused, the previous config runs: {short}",
                    self.path.display()
                );
                why = Some(short);
                ("refused", note, EventType::Warning)
            }
        };
        self.metrics
            .reloads
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
        match &outcome {
            Ok(generation) => {
                tracing::info!(path = %self.path.display(), generation, "config reloaded");
                self.metrics.refused.set(0);
                self.metrics
                    .generation
                    .set(i64::try_from(*generation).unwrap_or(i64::MAX));
                self.state.set(None);
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "config reload refused; the previous config runs");
                self.metrics.refused.set(1);
                self.state.set(why);
            }
        }
        if let Some((recorder, provider)) = &self.events {
            let reason = if outcome.is_ok() {
                "ConfigReloaded"
            } else {
                "ConfigRefused"
            };
            let ev = Event {
                type_,
                reason: reason.into(),
                note: Some(crate::controller::event_note(note)),
                action: "Reload".into(),
                secondary: None,
            };
            let reference = k8s_openapi::api::core::v1::ObjectReference {
                api_version: Some("egress-operator.dev/v1alpha1".into()),
                kind: Some("ProviderHealth".into()),
                name: Some(provider.clone()),
                ..Default::default()
            };
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::warn!(error = %e, reason, "could not publish event");
            }
        }
        Some(outcome.map_err(|e| e.to_string()))
    }

    /// Installs the file's config; `Ok(None)` when it equals the one in force (nothing
    /// rolls for an edit that changes nothing).
    async fn check_and_install(&self) -> Result<Option<u64>, Refused> {
        let path = self.path.clone();
        let engine = self.engine.clone();
        let old = self.live.config();
        // Parsing resolves relative paths and compiling blocks: off the async threads.
        let loaded = tokio::task::spawn_blocking(move || {
            let new = crate::config::load_file(&path).map_err(|e| {
                Refused::Invalid(
                    std::iter::once(e.to_string())
                        .chain(e.problems())
                        .collect::<Vec<_>>()
                        .join("; "),
                )
            })?;
            if new == *old {
                return Ok(None);
            }
            let restart = needs_restart(&old, &new);
            if !restart.is_empty() {
                return Err(Refused::NeedsRestart(restart));
            }
            let new = new.with_identity_of(&old);
            let set = TemplateSet::load(&engine, &new.kvm2.templates);
            let problems: Vec<String> = set
                .health()
                .into_iter()
                .filter_map(|h| h.problem.map(|p| format!("{}: {p}", h.plugin)))
                .collect();
            if !problems.is_empty() {
                return Err(Refused::Plugin(problems.join("; ")));
            }
            Ok(Some((new, set)))
        })
        .await
        .map_err(|e| Refused::Invalid(format!("the check panicked: {e}")))??;
        Ok(loaded.map(|(new, set)| self.live.install(Arc::new(new), Arc::new(set))))
    }
}
