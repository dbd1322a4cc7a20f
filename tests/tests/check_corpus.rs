//! The output check against real plugins: the default domain plugin in every shape a site
//! uses (BIOS, UEFI, Secure Boot, two and four NICs on the same bridge, no RNG or balloon,
//! each CPU mode) renders and passes; the hostile plugin's escapes do not.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use egress_operator::api::proxy;
use egress_operator::config::{self, TemplateConfig};
use egress_operator::render::{self, Facts};
use egress_operator::templates::check::check_domain_xml;
use egress_operator::templates::{Firmware, TemplateEngine, TemplateErrorKind};
use integration_tests::{plugin_path, workspace_root};
use serde_json::json;

const CREATED_AT: &str = "2026-01-01T00:00:00Z";

fn domain_template(settings: serde_json::Value) -> TemplateConfig {
    TemplateConfig {
        path: Some(plugin_path("domain-default").unwrap().display().to_string()),
        url: None,
        sha256: None,
        credentials_file: None,
        settings,
        overridable_settings: Vec::new(),
        timeout_millis: 2000,
        max_memory_mib: 64,
    }
}

fn inputs(kvm: bool) -> render::Inputs {
    let root = workspace_root().join("config/samples");
    let config = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let proxy = proxy::load_manifest(&root.join("proxy_kvm2.yaml"), &config).unwrap();
    let facts = Facts {
        kvm,
        ..Facts::default()
    };
    render::inputs(&config, &proxy, None, &facts, CREATED_AT).unwrap()
}

#[test]
fn every_shape_of_the_default_plugin_passes_the_check() {
    let engine = TemplateEngine::new(None).unwrap();
    let shapes = [
        (json!({}), Firmware::Bios, false),
        (json!({}), Firmware::Bios, true),
        (json!({"machine": "pc"}), Firmware::Bios, false),
        (json!({}), Firmware::Efi, false),
        (
            json!({"uefi": {"secureBoot": true, "loader": "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd", "nvramTemplate": "/usr/share/OVMF/OVMF_VARS_4M.ms.fd"}}),
            Firmware::Efi,
            true,
        ),
        (json!({"extraNics": 1}), Firmware::Bios, false),
        (json!({"extraNics": 3}), Firmware::Efi, true),
        (
            json!({"rng": false, "memballoon": false}),
            Firmware::Bios,
            false,
        ),
        (json!({"cpuMode": "host-passthrough"}), Firmware::Bios, true),
        (json!({"cpuMode": "default"}), Firmware::Bios, true),
    ];
    for (settings, firmware, kvm) in shapes {
        let plugin = engine
            .load_domain(&domain_template(settings.clone()))
            .unwrap();
        let mut input = inputs(kvm).domain;
        input.firmware = firmware;
        // render() runs the check; run it again here so a skipped check cannot pass.
        let xml = plugin
            .render(&input)
            .unwrap_or_else(|e| panic!("{settings} {firmware:?}: {e}"));
        check_domain_xml(&xml, &input).unwrap();
        let nics = xml.matches("<interface ").count();
        let extra = settings["extraNics"].as_u64().unwrap_or(0) as usize;
        assert_eq!(nics, 1 + extra, "{settings}: {xml}");
        assert_eq!(xml.matches("<mac ").count(), 1, "only the operator's MAC");
    }
}

#[test]
fn an_efi_render_of_a_bios_machine_type_is_refused() {
    // A plugin that ignores the machine type's firmware: the check ties it to the input.
    let engine = TemplateEngine::new(None).unwrap();
    let plugin = engine.load_domain(&domain_template(json!({}))).unwrap();
    let mut input = inputs(false).domain;
    input.firmware = Firmware::Efi;
    let xml = plugin.render(&input).unwrap();
    input.firmware = Firmware::Bios;
    match check_domain_xml(&xml, &input) {
        Err(TemplateErrorKind::InvalidOutput { rule, .. }) => assert_eq!(rule, "firmware-matches"),
        other => panic!("{other:?}"),
    }
    // And a render for fewer vCPUs than the machine type is refused.
    let mut fewer = inputs(false).domain;
    let xml = plugin.render(&fewer).unwrap();
    fewer.vcpus += 1;
    match check_domain_xml(&xml, &fewer) {
        Err(TemplateErrorKind::InvalidOutput { rule, detail }) => {
            assert_eq!(rule, "vcpus-match", "{detail}");
            assert!(detail.contains("/domain/vcpu"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}
