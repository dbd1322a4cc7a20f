//! `plugin test`: loads a built plugin with the given settings (checked against its schema
//! and its `validate-settings`, as the operator does at load), renders every case of the
//! [`matrix`] through the operator's own entry points (`render_on` with the
//! host's policy for domain XML, `render_with` for vendor-data: the output checks run
//! inside them), and records a verdict per case.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::config::{TemplateConfig, ValidConfig};
use crate::render::Facts;
use crate::templates::check::HostPolicy;
use crate::templates::{
    DomainTemplate, TemplateEngine, TemplateError, TemplateErrorKind, TemplateKind,
    VendorDataTemplate,
};

use super::matrix::{self, Case};
use super::{AuthoringError, Kind};

/// The settings key through which the matrix asks a domain plugin for further NICs (the
/// default plugin's and `plugin new`'s). A plugin without it gets only one-NIC cases.
pub const NICS_SETTING: &str = "extraNics";

/// What `plugin test` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct TestOptions {
    /// The component file.
    pub plugin: PathBuf,
    /// Its kind; found from its exports when `None`.
    pub kind: Option<Kind>,
    /// Settings file (YAML or JSON); `{}` when `None`.
    pub settings: Option<PathBuf>,
    /// Providers config whose hosts and machine types to render for; a sample when `None`.
    pub config: Option<PathBuf>,
    /// Write every output (or refusal) here.
    pub snapshot: Option<PathBuf>,
    /// Cache compiled plugins here.
    pub cache_dir: Option<PathBuf>,
    /// Registry credentials (Docker config JSON) when `plugin` is an `oci://` reference.
    pub credentials_file: Option<PathBuf>,
    /// PEM certificates to trust instead of the system's for an `oci://` plugin.
    pub ca_file: Option<PathBuf>,
    /// What every host is taken to have (KVM, CPUs, NUMA nodes); a host with `disableKvm`
    /// still renders for emulation.
    pub facts: Facts,
}

/// The verdict on one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Rendered, and the output passed every check.
    Pass,
    /// Refused: the rule, where (an element path, when the refusal names one) and why.
    Fail {
        /// The check's rule name, or what stopped the render (`refused`, `trap`, ...).
        rule: String,
        /// The path the refusal names, if any.
        path: Option<String>,
        /// The whole reason.
        detail: String,
        /// The rule's section of the rules page, for a rule of the output checks.
        see: Option<String>,
    },
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The case.
    pub case: Case,
    /// How it went.
    pub verdict: Verdict,
}

/// Everything `plugin test` found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The plugin's kind.
    pub kind: TemplateKind,
    /// Its name in the operator's terms (`domain:<path>`).
    pub plugin: String,
    /// Its sha256 (what a `url` entry pins).
    pub sha256: String,
    /// Remarks on the matrix (an axis that does not apply, say).
    pub notes: Vec<String>,
    /// What the plugin lacks that the operator relies on (the cases still pass).
    pub warnings: Vec<String>,
    /// One per case.
    pub outcomes: Vec<Outcome>,
}

impl Report {
    /// Whether every case passed.
    pub fn passed(&self) -> bool {
        self.outcomes.iter().all(|o| o.verdict == Verdict::Pass)
    }
}

enum Loaded {
    Domain(DomainTemplate),
    VendorData(VendorDataTemplate),
}

/// Reads a settings file: YAML or JSON (JSON is YAML).
pub fn read_settings(path: &Path) -> Result<Value, AuthoringError> {
    let fail = |reason: String| AuthoringError::SettingsFile {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| AuthoringError::io(path, e))?;
    let limit = crate::config::validate::limits::TEMPLATE_SETTINGS_BYTES;
    if text.len() > limit {
        return Err(fail(format!(
            "is {} bytes; settings are at most {limit}",
            text.len()
        )));
    }
    serde_yaml_ng::from_str::<Value>(&text).map_err(|e| fail(e.to_string()))
}

/// The template entry `plugin test` loads: the file (or the `oci://` reference, with its
/// credentials), the settings, the defaults of every limit, and [`NICS_SETTING`] and
/// `overridable` overridable so the matrix can set them per case.
fn template_config(
    plugin: &Path,
    credentials: Option<&Path>,
    settings: Value,
    overridable: &[&str],
) -> Result<TemplateConfig, AuthoringError> {
    let mut keys = vec![NICS_SETTING];
    keys.extend(overridable.iter().filter(|k| **k != NICS_SETTING));
    let source = plugin.display().to_string();
    let mut entry = json!({
        "settings": settings,
        "overridableSettings": keys,
    });
    if source.starts_with("oci://") {
        // Refused here, with the reason, rather than as a file that does not exist.
        crate::templates::oci::OciRef::parse(&source)?;
        entry["url"] = json!(source);
        if let Some(c) = credentials {
            entry["credentialsFile"] = json!(c.display().to_string());
        }
    } else {
        entry["path"] = json!(source);
    }
    serde_json::from_value(entry).map_err(|e| AuthoringError::Matrix {
        reason: format!("cannot make the template entry: {e}"),
    })
}

fn load(
    engine: &TemplateEngine,
    t: &TemplateConfig,
    kind: Option<Kind>,
) -> Result<Loaded, AuthoringError> {
    let as_domain = |engine: &TemplateEngine| engine.load_domain(t).map(Loaded::Domain);
    let as_vendor = |engine: &TemplateEngine| engine.load_vendor_data(t).map(Loaded::VendorData);
    match kind {
        Some(Kind::Domain) => Ok(as_domain(engine)?),
        Some(Kind::VendorData) => Ok(as_vendor(engine)?),
        // Exports are checked before settings, so an interface error means "not this
        // kind"; anything else (settings, a trap) is the plugin's answer as that kind.
        None => match as_domain(engine) {
            Ok(l) => Ok(l),
            Err(TemplateError {
                kind: TemplateErrorKind::Abi(domain),
                ..
            }) => match as_vendor(engine) {
                Ok(l) => Ok(l),
                Err(TemplateError {
                    kind: TemplateErrorKind::Abi(vendor_data),
                    ..
                }) => Err(AuthoringError::UnknownKind {
                    path: t.path.clone().unwrap_or_default(),
                    domain,
                    vendor_data,
                }),
                Err(e) => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        },
    }
}

/// Whether the plugin's settings schema declares a top-level [`NICS_SETTING`].
fn has_nics_setting(schema: &str) -> bool {
    serde_json::from_str::<Value>(schema)
        .ok()
        .and_then(|s| s.get("properties").map(|p| p.get(NICS_SETTING).is_some()))
        .unwrap_or(false)
}

/// The rule and path of a failed render.
pub fn verdict_of(e: &TemplateError) -> Verdict {
    // The rule has its own column; the reason is the rest.
    let detail = match &e.kind {
        TemplateErrorKind::InvalidOutput { detail, .. } => detail.clone(),
        other => other.to_string(),
    };
    let rule = match &e.kind {
        TemplateErrorKind::InvalidOutput { rule, .. } => (*rule).to_string(),
        TemplateErrorKind::OutputTooLarge { .. } => "output-size".into(),
        TemplateErrorKind::Refused(_) | TemplateErrorKind::RefusalTooLarge { .. } => {
            "refused".into()
        }
        TemplateErrorKind::Limit { limit } => format!("limit: {limit}"),
        TemplateErrorKind::Trap(_) => "trap".into(),
        TemplateErrorKind::Exit(_) => "exit".into(),
        TemplateErrorKind::Settings { .. } | TemplateErrorKind::Overrides { .. } => {
            "settings".into()
        }
        _ => "load".into(),
    };
    let (path, see) = match &e.kind {
        TemplateErrorKind::InvalidOutput { rule, detail } => (
            path_in(detail),
            Some(crate::templates::check::rules::link(rule)),
        ),
        _ => (None, None),
    };
    Verdict::Fail {
        rule,
        path,
        detail,
        see,
    }
}

/// The first element path a refusal names (the checks write it as `/domain/...`, with
/// `/@attr` for attributes and `[n]` for positions).
pub fn path_in(detail: &str) -> Option<String> {
    detail
        .split_whitespace()
        .find(|w| w.starts_with("/domain") || w.starts_with("/@"))
        .map(|w| w.trim_end_matches([':', ',', ';', '.', ')']).to_string())
}

/// Runs the matrix. An error is returned only when nothing could be tested (the plugin did
/// not load, its settings were refused, the config was invalid); failing cases are in the
/// report.
pub fn run(opts: &TestOptions) -> Result<Report, AuthoringError> {
    let settings = match &opts.settings {
        Some(path) => read_settings(path)?,
        None => Value::Object(Map::new()),
    };
    let config: Option<ValidConfig> = match &opts.config {
        Some(path) => Some(crate::config::load_file(path).map_err(AuthoringError::Config)?),
        None => None,
    };
    let (config, types) = matrix::prepare(config)?;
    let download_ca_pem = match &opts.ca_file {
        Some(p) => Some(std::fs::read(p).map_err(|e| AuthoringError::io(p, e))?),
        None => None,
    };
    let engine = TemplateEngine::with_options(&crate::templates::EngineOptions {
        cache_dir: opts.cache_dir.clone(),
        download_ca_pem,
    })?;
    let credentials = opts.credentials_file.as_deref();
    let t = template_config(&opts.plugin, credentials, settings.clone(), &[])?;
    let mut loaded = load(&engine, &t, opts.kind)?;
    let facts = &opts.facts;
    let (kind, plugin, sha256, schema) = match &loaded {
        Loaded::Domain(d) => (
            TemplateKind::Domain,
            d.name().to_string(),
            d.sha256().to_string(),
            d.settings_schema()?,
        ),
        Loaded::VendorData(v) => (
            TemplateKind::VendorData,
            v.name().to_string(),
            v.sha256().to_string(),
            v.settings_schema()?,
        ),
    };
    let nics = kind == TemplateKind::Domain && has_nics_setting(&schema);
    let mut notes = Vec::new();
    match kind {
        TemplateKind::Domain if !nics => notes.push(format!(
            "the plugin's settings have no `{NICS_SETTING}`: only one-NIC cases are rendered"
        )),
        TemplateKind::VendorData => notes.push(
            "NICs and addressing do not reach a vendor-data input: cases are hosts × firmware"
                .into(),
        ),
        TemplateKind::Domain => {}
    }
    // Every enum value and boolean of the plugin's own settings once, on the first case.
    let mut cases = matrix::cases(kind, &config, &types, nics);
    let variants = matrix::setting_variants(&schema, NICS_SETTING);
    if !variants.is_empty() {
        // Loaded again with those settings overridable, as a config could list them.
        let mut keys: Vec<&str> = variants.iter().map(|(k, _)| k.as_str()).collect();
        keys.dedup();
        let t = template_config(&opts.plugin, credentials, settings, &keys)?;
        loaded = load(
            &engine,
            &t,
            Some(match kind {
                TemplateKind::Domain => Kind::Domain,
                TemplateKind::VendorData => Kind::VendorData,
            }),
        )?;
    }
    if let Some(base) = cases.first().cloned().filter(|_| !variants.is_empty()) {
        notes.push(format!(
            "each enum value and boolean of the plugin's settings is rendered once more, on \
             `{}` ({} case(s))",
            base.label(),
            variants.len()
        ));
        cases.extend(variants.into_iter().map(|(key, value)| Case {
            settings: vec![(key, value)],
            ..base.clone()
        }));
    }
    let mut outcomes = Vec::new();
    // Cases rendered without the guest agent's channel, and the hosts of the DHCP ones.
    let mut without_agent = 0usize;
    let mut dhcp_hosts: Vec<String> = Vec::new();
    for mut case in cases {
        let inputs = matrix::inputs(&config, &case, facts)?;
        let mut overrides: Map<String, Value> = case.settings.iter().cloned().collect();
        if let Some(n) = case.nics.filter(|_| nics) {
            overrides.insert(NICS_SETTING.into(), json!(n.saturating_sub(1)));
        }
        let overrides = (!overrides.is_empty()).then_some(overrides);
        let rendered = match &loaded {
            Loaded::Domain(d) => d.render_on(
                &inputs.domain,
                overrides.as_ref(),
                &HostPolicy::for_render(&inputs.host, &inputs.domain),
            ),
            Loaded::VendorData(v) => v.render_with(&inputs.vendor_data, overrides.as_ref()),
        };
        let verdict = match &rendered {
            Ok(_) => Verdict::Pass,
            Err(e) => verdict_of(e),
        };
        if kind == TemplateKind::Domain
            && let Ok(xml) = &rendered
        {
            case.rendered_nics = crate::templates::check::interface_count(xml);
        }
        if kind == TemplateKind::Domain
            && rendered
                .as_ref()
                .is_ok_and(|xml| !crate::templates::check::has_agent_channel(xml))
        {
            without_agent += 1;
            if case.addressing.is_some_and(matrix::Addressing::is_dhcp)
                && !dhcp_hosts.contains(&case.host)
            {
                dhcp_hosts.push(case.host.clone());
            }
        }
        if let Some(dir) = &opts.snapshot {
            snapshot(dir, kind, &case, &rendered)?;
        }
        outcomes.push(Outcome { case, verdict });
    }
    let mut warnings = Vec::new();
    if without_agent > 0 {
        warnings.push(agent_warning(without_agent, &dhcp_hosts));
    }
    Ok(Report {
        kind,
        plugin,
        sha256,
        notes,
        warnings,
        outcomes,
    })
}

/// What a domain without the agent's channel costs: the features that rely on it, and
/// the hosts whose DHCP cases rendered without it.
fn agent_warning(cases: usize, dhcp_hosts: &[String]) -> String {
    let address = if dhcp_hosts.is_empty() {
        String::new()
    } else {
        format!(
            " reading a DHCP proxy's address through the agent (DHCP cases on {}; libvirt's \
             DHCP leases and ARP remain), and",
            dhcp_hosts.join(", ")
        )
    };
    format!(
        "{cases} rendered domain(s) have no guest agent channel (<channel> with \
         target name {}), so these features do not work:{address} the check that a guest \
         applied its seed (a proxy on a stale seed is not caught)",
        crate::templates::check::AGENT_CHANNEL
    )
}

/// Writes one case's output (`<case>.xml` or `<case>.vendor-data`) or, when it failed,
/// its refusal (`<case>.refused.txt`).
fn snapshot(
    dir: &Path,
    kind: TemplateKind,
    case: &Case,
    rendered: &Result<String, TemplateError>,
) -> Result<(), AuthoringError> {
    std::fs::create_dir_all(dir).map_err(|e| AuthoringError::io(dir, e))?;
    let stem = case.file_stem();
    let output = dir.join(match kind {
        TemplateKind::Domain => format!("{stem}.xml"),
        TemplateKind::VendorData => format!("{stem}.vendor-data"),
    });
    let refusal = dir.join(format!("{stem}.refused.txt"));
    // A case's other file from an earlier run goes, so the directory shows this run only.
    let (path, text, stale) = match rendered {
        Ok(out) => (output, out.clone(), refusal),
        Err(e) => (refusal, format!("{}\n", e.kind), output),
    };
    match std::fs::remove_file(&stale) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(AuthoringError::io(&stale, e));
        }
        _ => {}
    }
    // Written to a new file beside it, then renamed over it: rename(2) replaces a symlink
    // planted at `path` instead of writing through it to wherever it points.
    let mut staged = tempfile::Builder::new()
        .prefix(".snapshot-")
        .tempfile_in(dir)
        .map_err(|e| AuthoringError::io(dir, e))?;
    std::io::Write::write_all(&mut staged, text.as_bytes())
        .map_err(|e| AuthoringError::io(&path, e))?;
    staged
        .persist(&path)
        .map_err(|e| AuthoringError::io(&path, e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_read_from_refusals() {
        for (detail, path) in [
            (
                "/domain/devices/hostdev is not on the allow-list",
                Some("/domain/devices/hostdev"),
            ),
            (
                "the machine type asks for UEFI: /domain/os needs a <loader> or firmware=\"efi\"",
                Some("/domain/os"),
            ),
            (
                "/domain/cputune/vcpupin[1] pins vCPU \"4\", the domain has 2",
                Some("/domain/cputune/vcpupin[1]"),
            ),
            (
                "/domain/os/loader/@type: must be pflash.",
                Some("/domain/os/loader/@type"),
            ),
            ("root element is <x>, not <domain>", None),
        ] {
            assert_eq!(path_in(detail).as_deref(), path, "{detail}");
        }
    }

    #[test]
    fn verdicts_name_the_rule() {
        let err = |kind| TemplateError {
            plugin: "domain:x".into(),
            kind,
        };
        assert_eq!(
            verdict_of(&err(TemplateErrorKind::InvalidOutput {
                rule: "interface-bridge-only",
                detail: "/domain/devices/interface[1]/source/@bridge is \"other\"".into(),
            })),
            Verdict::Fail {
                rule: "interface-bridge-only".into(),
                path: Some("/domain/devices/interface[1]/source/@bridge".into()),
                detail: "/domain/devices/interface[1]/source/@bridge is \"other\"".into(),
                see: Some("templates-sdk/src/rules.md#interface-bridge-only".into()),
            }
        );
        let Verdict::Fail {
            rule, path, see, ..
        } = verdict_of(&err(TemplateErrorKind::Trap("x".into())))
        else {
            panic!("a trap fails")
        };
        assert_eq!((rule.as_str(), path, see), ("trap", None, None));
    }

    #[test]
    fn a_snapshot_holds_this_run_only() {
        let dir = tempfile::tempdir().unwrap();
        let case = Case {
            host: "h".into(),
            machine_type: "small".into(),
            firmware: crate::config::Firmware::Bios,
            nics: Some(1),
            rendered_nics: None,
            addressing: Some(matrix::Addressing::Dhcp),
            settings: Vec::new(),
        };
        let refused = Err(TemplateError {
            plugin: "domain:x".into(),
            kind: TemplateErrorKind::Refused("no".into()),
        });
        snapshot(dir.path(), TemplateKind::Domain, &case, &refused).unwrap();
        let refusal = dir.path().join("h_bios_1-nic_dhcp.refused.txt");
        assert_eq!(
            std::fs::read_to_string(&refusal).unwrap(),
            "refused to render: no\n"
        );
        snapshot(
            dir.path(),
            TemplateKind::Domain,
            &case,
            &Ok("<domain/>".into()),
        )
        .unwrap();
        assert!(!refusal.exists());
        let output = dir.path().join("h_bios_1-nic_dhcp.xml");
        assert_eq!(std::fs::read_to_string(&output).unwrap(), "<domain/>");
        snapshot(dir.path(), TemplateKind::Domain, &case, &refused).unwrap();
        assert!(!output.exists() && refusal.exists());
    }

    #[test]
    fn a_snapshot_replaces_a_planted_symlink_and_leaves_its_target_alone() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "precious").unwrap();
        let snapshots = dir.path().join("snapshots");
        std::fs::create_dir(&snapshots).unwrap();
        let case = Case {
            host: "h".into(),
            machine_type: "small".into(),
            firmware: crate::config::Firmware::Bios,
            nics: Some(1),
            rendered_nics: None,
            addressing: Some(matrix::Addressing::Dhcp),
            settings: Vec::new(),
        };
        let output = snapshots.join("h_bios_1-nic_dhcp.xml");
        std::os::unix::fs::symlink(&victim, &output).unwrap();
        snapshot(
            &snapshots,
            TemplateKind::Domain,
            &case,
            &Ok("<domain/>".into()),
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(
            !std::fs::symlink_metadata(&output)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read_to_string(&output).unwrap(), "<domain/>");
        // No staging file is left beside the snapshots.
        let names: Vec<_> = std::fs::read_dir(&snapshots)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["h_bios_1-nic_dhcp.xml"]);
    }

    #[test]
    fn the_nics_axis_follows_the_schema() {
        assert!(has_nics_setting(
            r#"{"type":"object","properties":{"extraNics":{"type":"integer"}}}"#
        ));
        assert!(!has_nics_setting(
            r#"{"type":"object","properties":{"mode":{}}}"#
        ));
        assert!(!has_nics_setting("not json"));
    }

    #[test]
    fn settings_files_are_yaml_or_json() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("s.yaml");
        std::fs::write(&yaml, "extraNics: 2\nuefi: {secureBoot: false}\n").unwrap();
        assert_eq!(
            read_settings(&yaml).unwrap(),
            json!({"extraNics": 2, "uefi": {"secureBoot": false}})
        );
        let json_file = dir.path().join("s.json");
        std::fs::write(&json_file, r#"{"mode": "good"}"#).unwrap();
        assert_eq!(read_settings(&json_file).unwrap(), json!({"mode": "good"}));
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "a: [\n").unwrap();
        let e = read_settings(&bad).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("--settings {}", bad.display())),
            "{e}"
        );
    }
}
