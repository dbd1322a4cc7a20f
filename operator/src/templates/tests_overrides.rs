//! Per-Proxy settings overrides (`spec.templateSettings`) against the default plugins,
//! which `make plugins` builds into `target/plugins/`.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::{Value, json};

use super::*;
use crate::api::proxy::{ProxySpec, TemplateSettingsOverrides};
use crate::config::ValidConfig;
use crate::error::{Classified, ErrorClass};
use crate::provider::ProxyRef;
use crate::render::{self, Facts};
use crate::validation::Problems;

/// A component built by `make plugins`; a missing one fails the test, never skips it.
fn plugin(name: &str) -> String {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = target.join("plugins").join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is missing: run `make plugins` first",
        path.display()
    );
    path.display().to_string()
}

/// A config over the default plugins. The vendor-data plugin lets Proxies override
/// `listenPort` and `allowedClientCidrs`; the domain plugin lets them override `machine`.
fn config() -> ValidConfig {
    let yaml = format!(
        r#"
clusterId: test
kvm2:
  ssh: {{user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}}
  hosts:
    - {{name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}}
  images:
    - {{name: base, url: "https://images.example.org/b.qcow2", sha256: "{sha}", format: qcow2}}
  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}}
  defaults: {{machineType: small, image: base}}
  templates:
    domain:
      path: {domain}
      settings: {{machine: q35}}
      overridableSettings: [machine]
    vendorData:
      path: {vendor}
      settings: {{listenPort: 3128, allowedClientCidrs: [10.0.0.0/8], maxClients: 77}}
      overridableSettings: [listenPort, allowedClientCidrs]
"#,
        sha = "0".repeat(64),
        domain = plugin("domain-default"),
        vendor = plugin("vendor-data-default"),
    );
    crate::config::parse(&yaml, "overrides-test", std::path::Path::new("/")).unwrap()
}

/// Both plugins, loaded once for every test here (the engine lives as long as the binary).
fn plugins() -> &'static (DomainTemplate, VendorDataTemplate) {
    static PLUGINS: OnceLock<(DomainTemplate, VendorDataTemplate)> = OnceLock::new();
    PLUGINS.get_or_init(|| {
        let engine: &'static TemplateEngine =
            Box::leak(Box::new(TemplateEngine::new(None).unwrap()));
        let t = &config().kvm2.templates;
        (
            engine.load_domain(&t.domain).unwrap(),
            engine.load_vendor_data(&t.vendor_data).unwrap(),
        )
    })
}

fn spec(overrides: Option<TemplateSettingsOverrides>) -> ProxySpec {
    ProxySpec {
        provider: "kvm2".into(),
        template_settings: overrides,
        ..ProxySpec::default()
    }
}

fn vendor(overrides: Value) -> TemplateSettingsOverrides {
    TemplateSettingsOverrides {
        vendor_data: Some(serde_json::from_value(overrides).unwrap()),
        domain: None,
    }
}

fn inputs(spec: &ProxySpec) -> render::Inputs {
    let owner = ProxyRef {
        namespace: "default".into(),
        name: "office-egress".into(),
        uid: "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697801".into(),
    };
    render::inputs_for(
        &config(),
        &owner,
        spec,
        None,
        &Facts::default(),
        "2026-01-01T00:00:00Z",
    )
    .unwrap()
}

fn render_vendor(overrides: Value) -> Result<String, TemplateError> {
    let inputs = inputs(&spec(Some(vendor(overrides))));
    plugins()
        .1
        .render_with(&inputs.vendor_data, inputs.overrides.vendor_data.as_ref())
}

/// The issues of a refused override.
fn override_issues_of(r: Result<String, TemplateError>) -> Vec<OverrideIssue> {
    match r {
        Ok(out) => panic!("rendered instead of refusing ({} bytes)", out.len()),
        Err(e) => {
            assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
            assert!(e.plugin.starts_with("vendor-data:"), "{e}");
            match e.kind {
                TemplateErrorKind::Overrides { issues } => issues,
                other => panic!("not an overrides error: {other}"),
            }
        }
    }
}

#[test]
fn the_schema_is_compiled_once_at_load() {
    let (d, v) = plugins();
    assert!(d.loaded.schema.is_some() && v.loaded.schema.is_some());
}

#[test]
fn an_override_reaches_the_vendor_data_plugin_merged_over_the_config() {
    let plain = inputs(&spec(None));
    let base = plugins().1.render(&plain.vendor_data).unwrap();
    assert!(base.contains("Port 3128"), "{base}");
    assert!(!base.contains("Port 4242"), "{base}");

    let out = render_vendor(json!({"listenPort": 4242})).unwrap();
    assert!(out.contains("Port 4242"), "{out}");
    assert!(!out.contains("Port 3128"), "{out}");
    // A shallow merge: keys the Proxy leaves alone keep their configured values.
    assert!(out.contains("Allow 10.0.0.0/8"), "{out}");
    assert!(out.contains("MaxClients 77"), "{out}");

    // A list value replaces the configured one as a whole.
    let out = render_vendor(json!({"allowedClientCidrs": ["192.0.2.0/24"]})).unwrap();
    assert!(out.contains("Allow 192.0.2.0/24"), "{out}");
    assert!(!out.contains("Allow 10.0.0.0/8"), "{out}");
    assert!(out.contains("Port 3128"), "{out}");

    // No overrides and empty overrides are today's render.
    assert_eq!(
        plugins().1.render_with(&plain.vendor_data, None).unwrap(),
        base
    );
    assert_eq!(render_vendor(json!({})).unwrap(), base);
}

#[test]
fn an_override_reaches_the_domain_plugin() {
    let plain = inputs(&spec(None));
    let base = plugins().0.render(&plain.domain).unwrap();
    assert!(base.contains("q35"), "{base}");
    let overridden = inputs(&spec(Some(TemplateSettingsOverrides {
        domain: Some(serde_json::from_value(json!({"machine": "pc"})).unwrap()),
        vendor_data: None,
    })));
    let out = plugins()
        .0
        .render_with(&overridden.domain, overridden.overrides.domain.as_ref())
        .unwrap();
    assert!(!out.contains("q35"), "{out}");
    assert!(out.contains("machine=\"pc\""), "{out}");
    // The plugin's output is still checked: the mark is there.
    assert!(out.contains(&plain.domain.metadata_mark), "{out}");
}

#[test]
fn an_override_the_schema_refuses_names_the_proxy_field() {
    for bad in [json!(70000), json!("3129"), json!(0)] {
        let issues = override_issues_of(render_vendor(json!({"listenPort": bad})));
        assert_eq!(issues.len(), 1, "{bad}: {issues:?}");
        assert_eq!(
            issues[0].path, "spec.templateSettings.vendorData.listenPort",
            "{bad}"
        );
    }
    // The message names the field and the value it refused.
    let err = render_vendor(json!({"listenPort": 70000})).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("spec.templateSettings.vendorData.listenPort: 70000"),
        "{text}"
    );
}

#[test]
fn an_override_validate_settings_refuses_names_the_proxy_field() {
    // Fits the schema (a list of strings); only the plugin's own check refuses it, so this
    // proves `validate-settings` runs on the merged settings.
    let issues = override_issues_of(render_vendor(
        json!({"allowedClientCidrs": ["10.0.0.0/8", "not-a-cidr"]}),
    ));
    assert_eq!(issues.len(), 1, "{issues:?}");
    assert_eq!(
        issues[0].path,
        "spec.templateSettings.vendorData.allowedClientCidrs[1]"
    );
    assert!(issues[0].message.contains("CIDR"), "{issues:?}");
}

#[test]
fn a_key_not_listed_is_refused_at_render_too() {
    let issues = override_issues_of(render_vendor(json!({"maxClients": 5, "listenPort": 1})));
    assert_eq!(issues.len(), 1, "{issues:?}");
    assert_eq!(
        issues[0].path,
        "spec.templateSettings.vendorData.maxClients"
    );
    assert!(
        issues[0]
            .message
            .contains("kvm2.templates.vendorData.overridableSettings"),
        "{issues:?}"
    );
}

#[test]
fn overrides_over_settings_that_are_not_a_mapping_are_refused() {
    let t = &config().kvm2.templates.vendor_data;
    let engine = TemplateEngine::new(None).unwrap();
    let mut v = engine.load_vendor_data(t).unwrap();
    v.loaded.settings = json!([1]);
    let plain = inputs(&spec(None));
    let overrides: SettingsOverrides = serde_json::from_value(json!({"listenPort": 1})).unwrap();
    let err = v
        .render_with(&plain.vendor_data, Some(&overrides))
        .unwrap_err();
    assert!(
        matches!(&err.kind, TemplateErrorKind::Overrides { issues }
            if issues[0].path == "spec.templateSettings.vendorData"
            && issues[0].message.contains("not a mapping")),
        "{err}"
    );
}

#[test]
fn without_overrides_no_settings_call_is_made() {
    let loaded = &plugins().1.loaded;
    let calls = Cell::new(0);
    let validate = |_: &mut Store<RenderState>, _: &str| {
        calls.set(calls.get() + 1);
        Ok(Ok(()))
    };
    assert_eq!(
        loaded.settings_for(None, validate).unwrap(),
        loaded.settings_json
    );
    let empty = SettingsOverrides::new();
    assert_eq!(
        loaded.settings_for(Some(&empty), validate).unwrap(),
        loaded.settings_json
    );
    assert_eq!(calls.get(), 0);
    let one: SettingsOverrides = serde_json::from_value(json!({"listenPort": 8080})).unwrap();
    let merged = loaded.settings_for(Some(&one), validate).unwrap();
    assert_eq!(calls.get(), 1);
    let merged: Value = serde_json::from_str(&merged).unwrap();
    assert_eq!(
        merged,
        json!({"listenPort": 8080, "allowedClientCidrs": ["10.0.0.0/8"], "maxClients": 77})
    );
    // A value the schema refuses never reaches the plugin's own check.
    let bad: SettingsOverrides = serde_json::from_value(json!({"listenPort": -1})).unwrap();
    assert!(loaded.settings_for(Some(&bad), validate).is_err());
    assert_eq!(calls.get(), 1);
}

#[test]
fn proxy_spec_check_refuses_keys_the_config_does_not_list() {
    let config = config();
    let problems = |s: &ProxySpec| -> Vec<String> {
        let mut p = Problems::new();
        s.check(&config, &mut p);
        p.into_vec().iter().map(ToString::to_string).collect()
    };
    // Listed keys pass.
    assert_eq!(
        problems(&spec(Some(vendor(json!({"listenPort": 8080}))))),
        Vec::<String>::new()
    );
    let got = problems(&spec(Some(TemplateSettingsOverrides {
        domain: Some(serde_json::from_value(json!({"rng": false, "machine": "pc"})).unwrap()),
        vendor_data: Some(
            serde_json::from_value(json!({"listenPort": 1, "maxClients": 2})).unwrap(),
        ),
    })));
    assert_eq!(
        got,
        [
            "spec.templateSettings.domain.rng: is not overridable: \
             kvm2.templates.domain.overridableSettings lists only \"machine\"",
            "spec.templateSettings.vendorData.maxClients: is not overridable: \
             kvm2.templates.vendorData.overridableSettings lists only \"listenPort\", \
             \"allowedClientCidrs\"",
        ]
    );

    // A config that lists nothing allows nothing.
    let mut strict = (*config).clone();
    strict
        .kvm2
        .templates
        .vendor_data
        .overridable_settings
        .clear();
    let strict = crate::config::parse(
        &serde_yaml_ng::to_string(&strict).unwrap(),
        "strict",
        std::path::Path::new("/"),
    )
    .unwrap();
    let mut p = Problems::new();
    spec(Some(vendor(json!({"listenPort": 1})))).check(&strict, &mut p);
    let got: Vec<String> = p.into_vec().iter().map(ToString::to_string).collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].contains("lists nothing"), "{got:?}");

    // A hostile key is quoted in the path, never written raw.
    let got = problems(&spec(Some(vendor(json!({"a\nb.c": 1})))));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].starts_with("spec.templateSettings.vendorData[\"a\\nb.c\"]: "),
        "{got:?}"
    );
    assert!(!got[0].contains('\n'), "{got:?}");

    // An override document larger than a settings document is refused.
    let huge = "x".repeat(crate::config::validate::limits::TEMPLATE_SETTINGS_BYTES);
    let got = problems(&spec(Some(vendor(json!({"listenPort": huge})))));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].starts_with("spec.templateSettings.vendorData: is ") && got[0].contains("bytes"),
        "{got:?}"
    );
}
