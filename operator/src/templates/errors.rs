//! Errors of the template host, each naming the plugin and carrying a class.

use crate::error::{Classified, ErrorClass};

/// A template plugin failed to load, validate or render.
#[derive(Debug, thiserror::Error)]
#[error("template plugin {plugin:?}: {kind}")]
pub struct TemplateError {
    /// The plugin's name (`domain` or `vendor-data` plus its source).
    pub plugin: String,
    /// What went wrong.
    #[source]
    pub kind: TemplateErrorKind,
}

/// One setting that a plugin refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingsIssue {
    /// JSON pointer to the value inside the plugin's `settings`.
    pub pointer: String,
    /// Why.
    pub message: String,
}

impl std::fmt::Display for SettingsIssue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.pointer.is_empty() {
            "/"
        } else {
            &self.pointer
        };
        write!(f, "{at}: {}", self.message)
    }
}

/// One per-Proxy settings override that was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverrideIssue {
    /// The Proxy field, e.g. `spec.templateSettings.vendorData.listenPort`.
    pub path: String,
    /// Why.
    pub message: String,
}

impl std::fmt::Display for OverrideIssue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a render resource limit stopped the plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The wall-clock budget (epoch deadline) ran out.
    Timeout,
    /// The instruction budget (fuel) ran out.
    Fuel,
    /// The plugin tried to grow memory past its cap.
    Memory,
    /// The plugin wrote more than the captured stdout/stderr allows.
    Log,
    /// The plugin held more WASI resources (streams, pollables) or component handles at
    /// once than a call may (see `sandbox::MAX_RESOURCES`).
    Resources,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::Timeout => "ran past its time budget",
            Limit::Fuel => "ran out of fuel (instruction budget)",
            Limit::Memory => "exceeded its memory cap",
            Limit::Log => "wrote more to stdout/stderr than is captured",
            Limit::Resources => {
                "held more WASI resources (streams, pollables) or handles at once than a call may"
            }
        })
    }
}

/// What went wrong with a template plugin.
#[derive(Debug, thiserror::Error)]
pub enum TemplateErrorKind {
    /// The component file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The component could not be downloaded.
    #[error("cannot download {url}: {reason}")]
    Download {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The component could not be pulled from an OCI registry (or what the registry
    /// served is not the pinned plugin).
    #[error("cannot pull {reference}: {source}")]
    Oci {
        /// The `oci://` reference.
        reference: String,
        /// Why (boxed: the other variants are small, and every `Result` carrying a
        /// template error pays for the largest).
        #[source]
        source: Box<super::oci::OciError>,
    },
    /// The component's sha256 differs from the configured one.
    #[error("sha256 mismatch: expected {expected}, got {actual}")]
    Sha256Mismatch {
        /// Configured digest.
        expected: String,
        /// Digest of the bytes read.
        actual: String,
    },
    /// The file is larger than a component may be.
    #[error("component is {size} bytes; at most {max} are accepted")]
    TooLarge {
        /// Its size.
        size: u64,
        /// The cap.
        max: u64,
    },
    /// The bytes are not a valid WebAssembly component.
    #[error("not a valid WebAssembly component: {0}")]
    Compile(String),
    /// The component imports something the sandbox does not provide.
    #[error(
        "imports {}, which the sandbox does not provide (allowed: wasi:cli environment/exit/stdio/terminal, wasi:io error/poll/streams)",
        imports.join(", ")
    )]
    ForbiddenImport {
        /// Every refused import, by name.
        imports: Vec<String>,
    },
    /// The component does not export the expected interface or version.
    #[error("{0}")]
    Abi(String),
    /// The plugin's exported settings schema is not a usable JSON Schema.
    #[error("its settings-schema is not a valid JSON Schema: {0}")]
    BadSchema(String),
    /// The plugin's exported settings schema breaks a limit the host puts on schemas (size,
    /// nesting, references, patterns, compile or evaluation time), so it is never compiled
    /// or never used.
    #[error(
        "its settings-schema is refused by rule {rule:?} (see {}): {detail}",
        super::check::rules::link(rule)
    )]
    SchemaRefused {
        /// Short name of the rule (`schema-size`, `schema-depth`, `schema-ref`, ...).
        rule: &'static str,
        /// Where and what.
        detail: String,
    },
    /// The configured settings were refused.
    #[error("settings refused: {}", issues.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Settings {
        /// Every problem, with its JSON pointer.
        issues: Vec<SettingsIssue>,
    },
    /// A Proxy's settings overrides (`spec.templateSettings`) were refused: a key the
    /// config does not list as overridable, or merged settings the plugin's schema or
    /// `validate-settings` refuse.
    #[error("this Proxy's settings overrides were refused: {}", issues.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Overrides {
        /// Every problem, with the Proxy field it is in.
        issues: Vec<OverrideIssue>,
    },
    /// A resource limit stopped the plugin.
    #[error("{limit}")]
    Limit {
        /// Which limit.
        limit: Limit,
    },
    /// The plugin called `exit`.
    #[error("called exit({0}); plugins must return, not exit")]
    Exit(i32),
    /// The plugin trapped (panic, unreachable, out-of-bounds access, ...).
    #[error("trapped: {0}")]
    Trap(String),
    /// The plugin's render returned an error.
    #[error("refused to render: {0}")]
    Refused(String),
    /// The plugin's render returned an error message longer than is read.
    #[error("refused to render with a message of {size} bytes; at most {max} are read")]
    RefusalTooLarge {
        /// Length the plugin declared for its message.
        size: usize,
        /// The cap.
        max: usize,
    },
    /// The output is larger than its cap.
    #[error("output is {size} bytes; at most {max} are accepted")]
    OutputTooLarge {
        /// Output size.
        size: usize,
        /// The cap.
        max: usize,
    },
    /// The output broke a rule.
    #[error(
        "output refused by rule {rule:?} (see {}): {detail}",
        super::check::rules::link(rule)
    )]
    InvalidOutput {
        /// Short name of the rule (`one-domain`, `metadata-mark`, `no-hostdev`, ...).
        rule: &'static str,
        /// Where and what.
        detail: String,
    },
    /// The compiled-code cache directory could not be created.
    #[error("cannot use cache directory {path}: {source}")]
    CacheDir {
        /// The directory.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The engine could not be set up (a wasmtime configuration problem).
    #[error("engine setup failed: {0}")]
    Engine(String),
}

impl Classified for TemplateError {
    fn class(&self) -> ErrorClass {
        match &self.kind {
            // The wall clock depends on host load: the same render may fit next time.
            TemplateErrorKind::Limit {
                limit: Limit::Timeout,
            } => ErrorClass::Transient,
            TemplateErrorKind::Read { source, .. }
                if source.kind() != std::io::ErrorKind::NotFound =>
            {
                ErrorClass::Transient
            }
            TemplateErrorKind::CacheDir { .. } | TemplateErrorKind::Download { .. } => {
                ErrorClass::Transient
            }
            TemplateErrorKind::Oci { source, .. } => source.class(),
            // Everything else is deterministic: same plugin, same input, same failure.
            _ => ErrorClass::Permanent,
        }
    }
}
