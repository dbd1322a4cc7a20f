//! `validate-config`: the providers config, Proxy manifests against it, and the template
//! plugins' settings, all before a rollout.
//!
//! A config can be valid YAML of the right shape and still carry settings its plugin
//! refuses: only the plugin knows its settings (its exported JSON Schema and
//! `validate-settings`). So the command loads each plugin it can reach, exactly as the
//! operator would at start, and reports a refused setting at its JSON pointer. A plugin
//! it cannot reach here (a `path` that exists only in the operator's image, a `url` that
//! is neither cached nor reachable) is said to be unchecked, not passed off as valid.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::api::proxy::ProxyManifest;
use crate::config::{self, TemplateConfig, ValidConfig};
use crate::templates::{
    EngineOptions, SettingsOverrides, TemplateEngine, TemplateError, TemplateErrorKind,
    TemplateKind,
};

/// What `validate-config` checks besides the config itself.
#[derive(Debug, Clone, Default)]
pub struct ValidateOptions {
    /// Proxy manifests to check against the config (and their settings overrides against
    /// the plugins).
    pub proxies: Vec<PathBuf>,
    /// Load `path` plugins from this directory instead (same file names), as `render`
    /// and `provision` do: the config's paths are usually inside the operator's image.
    pub plugin_dir: Option<PathBuf>,
    /// Compiled-plugin cache (the operator's `--plugin-cache-dir`): a `url` plugin cached
    /// there is checked without a download.
    pub plugin_cache_dir: Option<PathBuf>,
    /// PEM certificates to trust for `url` plugin downloads.
    pub plugin_ca_file: Option<PathBuf>,
    /// Check the config and manifests only.
    pub skip_plugins: bool,
}

/// How one plugin's check ended.
#[derive(Debug)]
enum PluginOutcome {
    /// Loaded; its settings (and every manifest's overrides of them) were accepted.
    Accepted,
    /// Could not be had here: not checked. Says why.
    Unreachable(String),
    /// Loaded or failed to load with problems, one line each.
    Refused(Vec<String>),
}

/// Runs the command: exit 0 when everything checked is valid, 1 when anything is refused.
pub fn run(
    file: &Path,
    options: &ValidateOptions,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<u8> {
    let config = match config::load_file(file) {
        Ok(c) => c,
        Err(e) => {
            report(&e, err)?;
            return Ok(1);
        }
    };
    let mut failed = false;
    let mut manifests = Vec::new();
    for proxy in &options.proxies {
        match crate::api::proxy::load_manifest(proxy, &config) {
            Ok(m) => manifests.push((proxy.clone(), m)),
            Err(e) => {
                report(&e, err)?;
                failed = true;
            }
        }
    }
    if failed {
        return Ok(1);
    }
    let mut checked = Vec::new();
    if !options.skip_plugins {
        let engine = match engine(options) {
            Ok(e) => e,
            Err(message) => {
                writeln!(err, "{message}")?;
                return Ok(1);
            }
        };
        for kind in [TemplateKind::Domain, TemplateKind::VendorData] {
            let field = format!("kvm2.templates.{}", kind.field());
            match check_plugin(&engine, &config, kind, options, &manifests) {
                PluginOutcome::Accepted => checked.push(kind.field()),
                PluginOutcome::Unreachable(why) => {
                    writeln!(err, "{field}: not checked: {why}")?;
                }
                PluginOutcome::Refused(problems) => {
                    writeln!(
                        err,
                        "{}: {field}: {} problem(s)",
                        file.display(),
                        problems.len()
                    )?;
                    for p in problems {
                        writeln!(err, "  {p}")?;
                    }
                    failed = true;
                }
            }
        }
    }
    if failed {
        return Ok(1);
    }
    let mut extra = match options.proxies.len() {
        0 => String::new(),
        n => format!(", {n} Proxy manifest(s) checked"),
    };
    if !checked.is_empty() {
        extra.push_str(&format!(
            ", plugin settings checked: {}",
            checked.join(", ")
        ));
    }
    writeln!(
        out,
        "{}: valid: {}{extra}",
        file.display(),
        config.summary()
    )?;
    Ok(0)
}

/// Prints a config or manifest error with each of its problems on a line.
pub fn report(e: &config::ConfigError, err: &mut dyn Write) -> std::io::Result<()> {
    match e {
        config::ConfigError::Invalid { document, problems } => {
            writeln!(err, "{document}: {} problem(s)", problems.len())?;
            for p in problems {
                writeln!(err, "  {p}")?;
            }
            Ok(())
        }
        other => writeln!(err, "{other}"),
    }
}

fn engine(options: &ValidateOptions) -> Result<TemplateEngine, String> {
    let download_ca_pem = match &options.plugin_ca_file {
        None => None,
        Some(path) => Some(
            crate::run::read_ca_file(path)
                .map_err(|e| format!("--plugin-ca-file {}: {e}", path.display()))?,
        ),
    };
    TemplateEngine::with_options(&EngineOptions {
        cache_dir: options.plugin_cache_dir.clone(),
        download_ca_pem,
    })
    .map_err(|e| e.to_string())
}

/// The entry of `kind` with its path moved into `plugin_dir` when one is given.
pub fn entry_in(t: &TemplateConfig, plugin_dir: Option<&Path>) -> TemplateConfig {
    let mut t = t.clone();
    if let Some(dir) = plugin_dir
        && let Some(file) = t.path.as_deref().and_then(|p| Path::new(p).file_name())
    {
        t.path = Some(dir.join(file).display().to_string());
    }
    t
}

fn check_plugin(
    engine: &TemplateEngine,
    config: &ValidConfig,
    kind: TemplateKind,
    options: &ValidateOptions,
    manifests: &[(PathBuf, ProxyManifest)],
) -> PluginOutcome {
    let entry = match kind {
        TemplateKind::Domain => &config.kvm2.templates.domain,
        TemplateKind::VendorData => &config.kvm2.templates.vendor_data,
    };
    let entry = entry_in(entry, options.plugin_dir.as_deref());
    let field = kind.field();
    let overrides_of = |m: &ProxyManifest| -> Option<SettingsOverrides> {
        let ts = m.spec.template_settings.as_ref()?;
        match kind {
            TemplateKind::Domain => ts.domain.clone(),
            TemplateKind::VendorData => ts.vendor_data.clone(),
        }
    };
    // Each kind's check of a manifest's overrides, as a render would merge them.
    let checked: Result<Vec<(PathBuf, TemplateError)>, TemplateError> = match kind {
        TemplateKind::Domain => engine.load_domain(&entry).map(|t| {
            manifests
                .iter()
                .filter_map(|(p, m)| {
                    let o = overrides_of(m)?;
                    t.check_overrides(Some(&o)).err().map(|e| (p.clone(), e))
                })
                .collect()
        }),
        TemplateKind::VendorData => engine.load_vendor_data(&entry).map(|t| {
            manifests
                .iter()
                .filter_map(|(p, m)| {
                    let o = overrides_of(m)?;
                    t.check_overrides(Some(&o)).err().map(|e| (p.clone(), e))
                })
                .collect()
        }),
    };
    match checked {
        Ok(refused) if refused.is_empty() => PluginOutcome::Accepted,
        Ok(refused) => PluginOutcome::Refused(
            refused
                .iter()
                .flat_map(|(path, e)| {
                    problem_lines(&e.kind, field, &e.plugin)
                        .into_iter()
                        .map(move |line| format!("{}: {line}", path.display()))
                })
                .collect(),
        ),
        Err(e) => match unreachable(&e.kind, options) {
            Some(why) => PluginOutcome::Unreachable(why),
            None => PluginOutcome::Refused(problem_lines(&e.kind, field, &e.plugin)),
        },
    }
}

/// Why a plugin that failed to load could not be had here at all (so it is unchecked,
/// not refused), or `None` when it was had and refused.
fn unreachable(kind: &TemplateErrorKind, options: &ValidateOptions) -> Option<String> {
    match kind {
        TemplateErrorKind::Read { path, source }
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            let hint = if options.plugin_dir.is_some() {
                "it is not in --plugin-dir either"
            } else {
                "pass --plugin-dir DIR to check the settings against a local build of it"
            };
            Some(format!("{path} does not exist here ({hint})"))
        }
        TemplateErrorKind::Download { url, reason } => {
            let cache = match &options.plugin_cache_dir {
                Some(dir) => format!("it is not in the plugin cache {}", dir.display()),
                None => "no --plugin-cache-dir was given to look in".into(),
            };
            Some(format!(
                "{url} cannot be downloaded from here ({reason}), and {cache}"
            ))
        }
        // The registry cannot be had here (not what it served: that is a refusal).
        TemplateErrorKind::Oci { reference, source }
            if crate::error::Classified::class(source.as_ref())
                == crate::error::ErrorClass::Transient =>
        {
            let cache = match &options.plugin_cache_dir {
                Some(dir) => format!(
                    "it is not in the plugin cache {} (`plugin test {reference} --cache-dir {}` \
                     records it there)",
                    dir.display(),
                    dir.display()
                ),
                None => "no --plugin-cache-dir was given to look in".into(),
            };
            Some(format!(
                "{reference} cannot be pulled from here ({source}), and {cache}"
            ))
        }
        _ => None,
    }
}

/// One line per problem: settings issues at `kvm2.templates.<kind>.settings<pointer>`,
/// override issues at their Proxy field, anything else at the plugin.
fn problem_lines(kind: &TemplateErrorKind, field: &str, plugin: &str) -> Vec<String> {
    match kind {
        TemplateErrorKind::Settings { issues } => issues
            .iter()
            .map(|i| {
                format!(
                    "kvm2.templates.{field}.settings{}: {}",
                    i.pointer, i.message
                )
            })
            .collect(),
        TemplateErrorKind::Overrides { issues } => issues.iter().map(ToString::to_string).collect(),
        other => vec![format!(
            "kvm2.templates.{field}: plugin {plugin:?}: {other}"
        )],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::templates::SettingsIssue;

    #[test]
    fn settings_issues_are_named_by_their_config_pointer() {
        let kind = TemplateErrorKind::Settings {
            issues: vec![SettingsIssue {
                pointer: "/listenPrt".into(),
                message: "unknown key".into(),
            }],
        };
        assert_eq!(
            problem_lines(&kind, "vendorData", "p"),
            vec!["kvm2.templates.vendorData.settings/listenPrt: unknown key"]
        );
    }

    #[test]
    fn a_missing_path_is_unchecked_with_a_hint_and_a_bad_file_is_refused() {
        let missing = TemplateErrorKind::Read {
            path: "/nonexistent/p.wasm".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        let why = unreachable(&missing, &ValidateOptions::default()).unwrap();
        assert!(why.contains("--plugin-dir"), "{why}");
        let bad = TemplateErrorKind::Compile("bad magic".into());
        assert!(unreachable(&bad, &ValidateOptions::default()).is_none());
        let denied = TemplateErrorKind::Read {
            path: "/root/p.wasm".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert!(unreachable(&denied, &ValidateOptions::default()).is_none());
    }

    /// The download refusal reads as a sentence both ways (issue 34: it read "... and is
    /// no --plugin-cache-dir was given").
    #[test]
    fn an_unreachable_url_says_where_else_it_was_looked_for() {
        let kind = TemplateErrorKind::Download {
            url: "https://plugins.example/d.wasm".into(),
            reason: "io: connection refused".into(),
        };
        assert_eq!(
            unreachable(&kind, &ValidateOptions::default()).unwrap(),
            "https://plugins.example/d.wasm cannot be downloaded from here (io: connection \
             refused), and no --plugin-cache-dir was given to look in"
        );
        let cached = ValidateOptions {
            plugin_cache_dir: Some("/var/cache/p".into()),
            ..ValidateOptions::default()
        };
        assert_eq!(
            unreachable(&kind, &cached).unwrap(),
            "https://plugins.example/d.wasm cannot be downloaded from here (io: connection \
             refused), and it is not in the plugin cache /var/cache/p"
        );
    }

    #[test]
    fn plugin_dir_replaces_only_the_directory_of_a_path() {
        let entry: TemplateConfig = serde_json::from_value(
            serde_json::json!({"path": "/usr/lib/egress-operator/plugins/domain-default.wasm"}),
        )
        .unwrap();
        let moved = entry_in(&entry, Some(Path::new("/tmp/p")));
        assert_eq!(moved.path.as_deref(), Some("/tmp/p/domain-default.wasm"));
        let url: TemplateConfig =
            serde_json::from_value(serde_json::json!({"url": "https://x/p.wasm"})).unwrap();
        assert_eq!(entry_in(&url, Some(Path::new("/tmp/p"))), url);
    }
}
