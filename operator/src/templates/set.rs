//! The configured pair of plugins, with the health of each.
//!
//! Loading never fails as a whole: a plugin that cannot load or whose settings are refused
//! is kept as *unavailable, with its reason*, so the operator keeps running, reports the
//! reason (`/readyz`, metrics, `ProviderHealth`, the Proxy's condition), and only what
//! needs that plugin fails.
//!
//! The set is also the handle through which the provider reads the plugins: each slot sits
//! behind a lock, so the run mode can start with every plugin *loading* (its HTTP
//! endpoints are up before a slow download starts) and fill the slots from a background
//! loader while the provider keeps the same `Arc<TemplateSet>`. A slot moves only forward:
//! loading → loaded, or loading → failed for good; a loaded plugin is never replaced.
//! Readers take the lock only to clone an `Arc` of the plugin, never across a render.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{DomainTemplate, TemplateEngine, TemplateError, TemplateKind, VendorDataTemplate};
use crate::config::{TemplateConfig, TemplatesConfig};
use crate::error::{Classified, ErrorClass};

/// Reason a slot reports before its first load attempt finished.
const NOT_LOADED_YET: &str = "no load attempt has finished yet";

/// A plugin cannot be used now: it is still loading (transient: a Create that needs it is
/// retried later), or it failed for good (permanent: bad settings, a sha256 mismatch, a
/// forbidden import; it stays so until the config is fixed and the operator restarted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "template plugin {plugin:?} {}: {reason}",
    if *loading { "is not loaded yet (plugins loading; retried in the background)" } else { "is unhealthy" }
)]
pub struct PluginUnavailable {
    /// The plugin's name.
    pub plugin: String,
    /// Why it is not loaded: the last failure, or that no attempt has finished yet.
    pub reason: String,
    /// `true` while loading is still being retried.
    pub loading: bool,
}

impl Classified for PluginUnavailable {
    fn class(&self) -> ErrorClass {
        if self.loading {
            ErrorClass::Transient
        } else {
            ErrorClass::Permanent
        }
    }
}

/// Health of one plugin, for status reporting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginHealth {
    /// Which plugin.
    pub kind: TemplateKind,
    /// Its name (`domain:<source>`).
    pub plugin: String,
    /// `None` when loaded, else why not.
    pub problem: Option<String>,
    /// `true` while it is not loaded and loading is still retried (a transient problem);
    /// `false` when loaded or failed for good.
    pub loading: bool,
}

impl PluginHealth {
    /// Whether the plugin is loaded and usable.
    pub fn is_healthy(&self) -> bool {
        self.problem.is_none()
    }

    /// One word for the state: `loaded`, `loading` or `failed`.
    pub fn state(&self) -> &'static str {
        match (&self.problem, self.loading) {
            (None, _) => "loaded",
            (Some(_), true) => "loading",
            (Some(_), false) => "failed",
        }
    }
}

type Slot<T> = RwLock<Result<Arc<T>, PluginUnavailable>>;

/// Both plugins of a providers config.
#[derive(Debug)]
pub struct TemplateSet {
    domain: Slot<DomainTemplate>,
    vendor_data: Slot<VendorDataTemplate>,
}

/// The name a plugin is known by in logs, errors and status: `<kind>:<path or url>`
/// (the template host names it the same way when it loads it).
fn plugin_name(kind: TemplateKind, t: &TemplateConfig) -> String {
    let source = t.path.as_deref().or(t.url.as_deref()).unwrap_or("<none>");
    format!("{}:{source}", kind.as_str())
}

/// A poisoned lock only means a panic elsewhere while holding it; the slot value itself
/// is always whole (it is replaced in one assignment), so it stays usable.
fn read<T>(slot: &Slot<T>) -> RwLockReadGuard<'_, Result<Arc<T>, PluginUnavailable>> {
    slot.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(slot: &Slot<T>) -> RwLockWriteGuard<'_, Result<Arc<T>, PluginUnavailable>> {
    slot.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn pending<T>(kind: TemplateKind, t: &TemplateConfig) -> Slot<T> {
    RwLock::new(Err(PluginUnavailable {
        plugin: plugin_name(kind, t),
        reason: NOT_LOADED_YET.into(),
        loading: true,
    }))
}

impl TemplateSet {
    /// Loads and validates both plugins now, once; failures are recorded (as failed for
    /// good: nothing retries them), never raised. For the CLI and tests; the run mode uses
    /// [`TemplateSet::loading`] and loads in the background.
    pub fn load(engine: &TemplateEngine, templates: &TemplatesConfig) -> Self {
        let set = Self::loading(templates);
        for (kind, t) in [
            (TemplateKind::Domain, &templates.domain),
            (TemplateKind::VendorData, &templates.vendor_data),
        ] {
            if let Err(e) = set.load_one(engine, kind, t) {
                set.mark_failed(kind, &e, false);
            }
        }
        set
    }

    /// A set whose plugins are all *loading*: every use fails transiently until
    /// [`TemplateSet::load_one`] fills a slot.
    pub fn loading(templates: &TemplatesConfig) -> Self {
        Self {
            domain: pending(TemplateKind::Domain, &templates.domain),
            vendor_data: pending(TemplateKind::VendorData, &templates.vendor_data),
        }
    }

    /// One load attempt of the `kind` plugin from `t` (blocking: compiles, may download).
    /// On success the plugin is installed, unless one is already loaded (a slot never
    /// goes back or changes plugin). A failure is returned, not recorded: the caller knows
    /// whether it will retry ([`TemplateSet::mark_failed`]).
    pub fn load_one(
        &self,
        engine: &TemplateEngine,
        kind: TemplateKind,
        t: &TemplateConfig,
    ) -> Result<(), TemplateError> {
        match kind {
            TemplateKind::Domain => {
                let plugin = engine.load_domain(t)?;
                install(&self.domain, plugin);
            }
            TemplateKind::VendorData => {
                let plugin = engine.load_vendor_data(t)?;
                install(&self.vendor_data, plugin);
            }
        }
        Ok(())
    }

    /// Records a failed load of `kind`: still loading (`retrying`, a transient failure the
    /// caller retries) or failed for good. A loaded plugin is left alone.
    pub fn mark_failed(&self, kind: TemplateKind, e: &TemplateError, retrying: bool) {
        let problem = PluginUnavailable {
            plugin: e.plugin.clone(),
            reason: e.kind.to_string(),
            loading: retrying,
        };
        if retrying {
            tracing::warn!(plugin = %e.plugin, error = %e.kind, "template plugin not loaded yet; retrying");
        } else {
            tracing::error!(plugin = %e.plugin, error = %e.kind, "template plugin unhealthy");
        }
        match kind {
            TemplateKind::Domain => record(&self.domain, problem),
            TemplateKind::VendorData => record(&self.vendor_data, problem),
        }
    }

    /// The domain plugin, or why it is unavailable.
    pub fn domain(&self) -> Result<Arc<DomainTemplate>, PluginUnavailable> {
        read(&self.domain).clone()
    }

    /// The vendor-data plugin, or why it is unavailable.
    pub fn vendor_data(&self) -> Result<Arc<VendorDataTemplate>, PluginUnavailable> {
        read(&self.vendor_data).clone()
    }

    /// Health of both plugins, domain first.
    pub fn health(&self) -> Vec<PluginHealth> {
        let entry = |kind: TemplateKind, r: Result<&str, &PluginUnavailable>| match r {
            Ok(name) => PluginHealth {
                kind,
                plugin: name.to_string(),
                problem: None,
                loading: false,
            },
            Err(e) => PluginHealth {
                kind,
                plugin: e.plugin.clone(),
                problem: Some(e.reason.clone()),
                loading: e.loading,
            },
        };
        vec![
            entry(
                TemplateKind::Domain,
                read(&self.domain).as_ref().map(|d| d.name()),
            ),
            entry(
                TemplateKind::VendorData,
                read(&self.vendor_data).as_ref().map(|v| v.name()),
            ),
        ]
    }

    /// Whether both plugins are usable.
    pub fn is_healthy(&self) -> bool {
        read(&self.domain).is_ok() && read(&self.vendor_data).is_ok()
    }
}

fn install<T>(slot: &Slot<T>, plugin: T) {
    let mut s = write(slot);
    if s.is_err() {
        *s = Ok(Arc::new(plugin));
    }
}

fn record<T>(slot: &Slot<T>, problem: PluginUnavailable) {
    let mut s = write(slot);
    if s.is_err() {
        *s = Err(problem);
    }
}

#[cfg(test)]
mod tests {
    use super::super::TemplateErrorKind;
    use super::*;

    fn config(domain: &str, vendor: &str) -> TemplatesConfig {
        let t = |path: &str| -> TemplateConfig {
            serde_json::from_value(serde_json::json!({ "path": path })).unwrap()
        };
        TemplatesConfig {
            domain: t(domain),
            vendor_data: t(vendor),
        }
    }

    /// A default plugin built by `make plugins`; a missing one fails the test.
    fn built(name: &str) -> String {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target")
            });
        let path = target.join("plugins").join(format!("{name}.wasm"));
        assert!(
            path.exists(),
            "{} is missing: run `make plugins`",
            path.display()
        );
        path.display().to_string()
    }

    fn download_error(plugin: &str) -> TemplateError {
        TemplateError {
            plugin: plugin.into(),
            kind: TemplateErrorKind::Download {
                url: "https://127.0.0.1:1/d.wasm".into(),
                reason: "Connection refused".into(),
            },
        }
    }

    #[test]
    fn a_loading_set_fails_transiently_then_records_retries_and_permanent_failures() {
        let set = TemplateSet::loading(&config("/p/d.wasm", "/p/v.wasm"));
        assert!(!set.is_healthy());
        let err = set.domain().unwrap_err();
        assert_eq!(err.plugin, "domain:/p/d.wasm");
        assert!(err.loading);
        assert_eq!(err.class(), ErrorClass::Transient);
        assert!(err.to_string().contains("plugins loading"), "{err}");
        assert_eq!(set.health()[1].state(), "loading");

        // A transient failure keeps it loading, with the failure as the reason.
        set.mark_failed(
            TemplateKind::Domain,
            &download_error("domain:/p/d.wasm"),
            true,
        );
        let h = &set.health()[0];
        assert_eq!(
            (h.state(), h.problem.as_deref()),
            (
                "loading",
                Some("cannot download https://127.0.0.1:1/d.wasm: Connection refused")
            )
        );
        assert_eq!(set.domain().unwrap_err().class(), ErrorClass::Transient);

        // A permanent one ends loading: the reason stays, the class is permanent.
        let forbidden = TemplateError {
            plugin: "vendor-data:/p/v.wasm".into(),
            kind: TemplateErrorKind::Sha256Mismatch {
                expected: "aa".into(),
                actual: "bb".into(),
            },
        };
        set.mark_failed(TemplateKind::VendorData, &forbidden, false);
        let err = set.vendor_data().unwrap_err();
        assert!(!err.loading);
        assert_eq!(err.class(), ErrorClass::Permanent);
        assert!(
            err.to_string().contains("is unhealthy: sha256 mismatch"),
            "{err}"
        );
        assert_eq!(set.health()[1].state(), "failed");
        // The other slot is untouched.
        assert_eq!(set.health()[0].state(), "loading");
    }

    #[test]
    fn a_loaded_plugin_is_installed_in_place_and_never_replaced() {
        let engine = TemplateEngine::new(None).unwrap();
        let templates = config(&built("domain-default"), &built("vendor-data-default"));
        let set = Arc::new(TemplateSet::loading(&templates));
        // The handle a provider would hold sees the load without being replaced.
        let provider_view = set.clone();
        set.load_one(&engine, TemplateKind::Domain, &templates.domain)
            .unwrap();
        let loaded = provider_view.domain().unwrap();
        assert_eq!(set.health()[0].state(), "loaded");
        assert!(!set.is_healthy(), "vendor-data is still loading");

        // A failure reported late (a retry racing the success) does not unload it.
        set.mark_failed(TemplateKind::Domain, &download_error(loaded.name()), true);
        set.mark_failed(TemplateKind::Domain, &download_error(loaded.name()), false);
        assert!(Arc::ptr_eq(&loaded, &provider_view.domain().unwrap()));

        set.load_one(&engine, TemplateKind::VendorData, &templates.vendor_data)
            .unwrap();
        assert!(provider_view.is_healthy());
        assert!(
            provider_view
                .health()
                .iter()
                .all(|h| h.is_healthy() && !h.loading)
        );
    }

    #[test]
    fn load_records_every_failure_as_permanent_because_nothing_retries_it() {
        let engine = TemplateEngine::new(None).unwrap();
        let set = TemplateSet::load(
            &engine,
            &config("/nonexistent/d.wasm", &built("vendor-data-default")),
        );
        let err = set.domain().unwrap_err();
        assert!(!err.loading && err.reason.contains("cannot read"), "{err}");
        assert!(set.vendor_data().is_ok());
    }
}
