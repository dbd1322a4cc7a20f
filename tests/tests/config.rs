//! The providers config as users meet it: the committed schema, the samples, the CLI.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::PathBuf;

use egress_operator::cli::{Command, execute};
use egress_operator::config;
use integration_tests::workspace_root;

fn sample(name: &str) -> PathBuf {
    workspace_root().join("config/samples").join(name)
}

fn run(command: Command) -> (u8, String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = execute(command, &mut out, &mut err);
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

#[test]
fn committed_schema_is_current() {
    let path = workspace_root().join("config/schema/providers-config.schema.json");
    let committed = std::fs::read_to_string(&path).unwrap();
    assert!(
        committed == config::json_schema(),
        "{} is stale: run `make generate` and commit the result",
        path.display()
    );
}

fn committed_schema() -> jsonschema::Validator {
    let path = workspace_root().join("config/schema/providers-config.schema.json");
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    jsonschema::validator_for(&schema).unwrap()
}

#[test]
fn sample_config_is_valid_by_loader_and_by_schema() {
    let path = sample("providers-config.yaml");
    let loaded = config::load_file(&path).unwrap();
    assert_eq!(loaded.kvm2.hosts.len(), 2);
    assert_eq!(loaded.kvm2.images.len(), 1);
    assert_eq!(loaded.kvm2.machine_types.len(), 2);

    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.starts_with("# yaml-language-server: $schema=../schema/providers-config.schema.json"),
        "the sample must point editors at the schema"
    );
    let doc: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    let errors: Vec<String> = committed_schema()
        .iter_errors(&doc)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
}

#[test]
fn schema_catches_what_editors_should_flag() {
    let text = std::fs::read_to_string(sample("providers-config.yaml")).unwrap();
    let broken = text
        .replace("bridge: br-egress", "bridge: \"br egress\"")
        .replace("vcpus: 2", "vcpus: 0")
        .replace(
            "storagePool: default",
            "storagePool: default\n      colour: red",
        );
    let doc: serde_json::Value = serde_yaml_ng::from_str(&broken).unwrap();
    let errors: Vec<String> = committed_schema()
        .iter_errors(&doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    for want in [
        "/kvm2/hosts/0/bridge",
        "/kvm2/machineTypes/1/vcpus",
        "/kvm2/hosts/0",
    ] {
        assert!(
            errors.iter().any(|e| e.starts_with(want)),
            "{want} not in {errors:#?}"
        );
    }
}

#[test]
fn sample_proxy_is_valid_against_sample_config() {
    let (code, out, err) = run(Command::ValidateConfig {
        file: sample("providers-config.yaml"),
        proxies: vec![sample("proxy_kvm2.yaml")],
    });
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.contains("valid: cluster \"prod-eu-1\": 2 host(s)"),
        "{out}"
    );
    assert!(out.contains("1 Proxy manifest(s) checked"), "{out}");
}

#[test]
fn broken_copy_reports_each_problem_with_its_path() {
    let text = std::fs::read_to_string(sample("providers-config.yaml")).unwrap();
    let broken = text
        .replace("bridge: br-egress", "bridge: \"br 0\"")
        .replace("name: kvm-b", "name: kvm-a")
        .replace("url: https://images", "url: http://images")
        .replace("machineType: small", "machineType: tiny");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.yaml");
    std::fs::write(&file, broken).unwrap();
    let (code, out, err) = run(Command::ValidateConfig {
        file: file.clone(),
        proxies: vec![],
    });
    assert_eq!(code, 1);
    assert_eq!(out, "");
    for want in [
        "kvm2.hosts[0].bridge: \"br 0\" is not a valid interface name",
        "kvm2.hosts[1].bridge: \"br 0\" is not a valid interface name",
        "kvm2.hosts[1].name: \"kvm-a\" is a duplicate of kvm2.hosts[0].name",
        "kvm2.images[0].url: ",
        "kvm2.defaults.machineType: \"tiny\" does not name an entry of kvm2.machineTypes",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    assert!(
        err.starts_with(&format!("{}: 5 problem(s)", file.display())),
        "{err}"
    );
}

#[test]
fn proxy_with_dangling_references_is_refused() {
    let text = std::fs::read_to_string(sample("proxy_kvm2.yaml")).unwrap();
    let broken = text
        .replace("host: kvm-a", "host: kvm-z")
        .replace("image: debian-12", "image: \"../debian\"")
        .replace("kind: Proxy", "kind: Pod");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("proxy.yaml");
    std::fs::write(&file, broken).unwrap();
    let (code, _, err) = run(Command::ValidateConfig {
        file: sample("providers-config.yaml"),
        proxies: vec![file],
    });
    assert_eq!(code, 1);
    for want in [
        "kind: \"Pod\" is not \"Proxy\"",
        "spec.image: \"../debian\" does not name an entry of kvm2.images",
        "spec.host: \"kvm-z\" does not name an entry of kvm2.hosts (known: \"kvm-a\", \"kvm-b\")",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}

#[test]
fn config_schema_command_prints_the_schema() {
    let (code, out, _) = run(Command::ConfigSchema);
    assert_eq!(code, 0);
    assert_eq!(out, config::json_schema());
}

#[test]
fn proxy_overriding_a_setting_the_config_does_not_list_is_refused() {
    let text = std::fs::read_to_string(sample("proxy_kvm2.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let check = |overrides: &str| {
        let file = dir.path().join("proxy.yaml");
        std::fs::write(&file, format!("{text}  templateSettings:\n{overrides}")).unwrap();
        run(Command::ValidateConfig {
            file: sample("providers-config.yaml"),
            proxies: vec![file],
        })
    };
    // The sample config lets a Proxy override listenPort and allowedClientCidrs.
    let (code, _, err) =
        check("    vendorData: {listenPort: 8080, allowedClientCidrs: [10.1.0.0/16]}\n");
    assert_eq!((code, err.as_str()), (0, ""));
    let (code, _, err) =
        check("    vendorData: {listenPort: 8080, maxClients: 9}\n    domain: {machine: pc}\n");
    assert_eq!(code, 1, "{err}");
    for want in [
        "spec.templateSettings.domain.machine: is not overridable: \
         kvm2.templates.domain.overridableSettings lists nothing",
        "spec.templateSettings.vendorData.maxClients: is not overridable: \
         kvm2.templates.vendorData.overridableSettings lists only \"listenPort\", \
         \"allowedClientCidrs\"",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    assert!(!err.contains("listenPort:"), "{err}");
}

#[test]
fn schema_flags_a_bad_overridable_settings_entry() {
    let text = std::fs::read_to_string(sample("providers-config.yaml")).unwrap();
    let broken = text.replace("- listenPort", "- listen.port");
    assert_ne!(broken, text);
    let doc: serde_json::Value = serde_yaml_ng::from_str(&broken).unwrap();
    let errors: Vec<String> = committed_schema()
        .iter_errors(&doc)
        .map(|e| e.instance_path().to_string())
        .collect();
    assert_eq!(
        errors,
        ["/kvm2/templates/vendorData/overridableSettings/0"],
        "{errors:#?}"
    );
}
