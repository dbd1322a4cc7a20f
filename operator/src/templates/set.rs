//! The configured pair of plugins, with the health of each.
//!
//! Loading never fails as a whole: a plugin that cannot load or whose settings are refused
//! is kept as *unhealthy, with its reason*, so the operator keeps running, reports the
//! reason (health status, the Proxy's condition), and only what needs that plugin fails.

use super::{DomainTemplate, TemplateEngine, TemplateError, TemplateKind, VendorDataTemplate};
use crate::config::TemplatesConfig;
use crate::error::{Classified, ErrorClass};

/// A plugin is unhealthy; what needs it cannot proceed until the config is fixed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("template plugin {plugin:?} is unhealthy: {reason}")]
pub struct PluginUnavailable {
    /// The plugin's name.
    pub plugin: String,
    /// Why it failed to load or validate.
    pub reason: String,
}

impl Classified for PluginUnavailable {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// Health of one plugin, for status reporting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginHealth {
    /// Which plugin.
    pub kind: TemplateKind,
    /// Its name (`domain:<source>`), or the kind when it never loaded.
    pub plugin: String,
    /// `None` when healthy, else why not.
    pub problem: Option<String>,
}

/// Both plugins of a providers config.
#[derive(Debug)]
pub struct TemplateSet {
    domain: Result<DomainTemplate, PluginUnavailable>,
    vendor_data: Result<VendorDataTemplate, PluginUnavailable>,
}

fn unavailable(e: TemplateError) -> PluginUnavailable {
    tracing::error!(plugin = %e.plugin, error = %e.kind, "template plugin unhealthy");
    PluginUnavailable {
        plugin: e.plugin,
        reason: e.kind.to_string(),
    }
}

impl TemplateSet {
    /// Loads and validates both plugins; failures are recorded, never raised.
    pub fn load(engine: &TemplateEngine, templates: &TemplatesConfig) -> Self {
        Self {
            domain: engine.load_domain(&templates.domain).map_err(unavailable),
            vendor_data: engine
                .load_vendor_data(&templates.vendor_data)
                .map_err(unavailable),
        }
    }

    /// The domain plugin, or why it is unavailable.
    pub fn domain(&self) -> Result<&DomainTemplate, PluginUnavailable> {
        self.domain.as_ref().map_err(Clone::clone)
    }

    /// The vendor-data plugin, or why it is unavailable.
    pub fn vendor_data(&self) -> Result<&VendorDataTemplate, PluginUnavailable> {
        self.vendor_data.as_ref().map_err(Clone::clone)
    }

    /// Health of both plugins.
    pub fn health(&self) -> Vec<PluginHealth> {
        let entry = |kind: TemplateKind, r: Result<&str, &PluginUnavailable>| match r {
            Ok(name) => PluginHealth {
                kind,
                plugin: name.to_string(),
                problem: None,
            },
            Err(e) => PluginHealth {
                kind,
                plugin: e.plugin.clone(),
                problem: Some(e.reason.clone()),
            },
        };
        vec![
            entry(TemplateKind::Domain, self.domain.as_ref().map(|d| d.name())),
            entry(
                TemplateKind::VendorData,
                self.vendor_data.as_ref().map(|v| v.name()),
            ),
        ]
    }

    /// Whether both plugins are usable.
    pub fn is_healthy(&self) -> bool {
        self.domain.is_ok() && self.vendor_data.is_ok()
    }
}
