//! The providers config as users meet it: the committed schema, the samples, the CLI.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::PathBuf;

use egress_operator::cli::{Command, ValidateConfigArgs, execute};
use egress_operator::config;
use integration_tests::{plugin_path, workspace_root};

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

/// `validate-config FILE --proxy ...` with the plugins `make plugins` built in place of
/// the sample's (which name the operator image's paths).
fn validate(file: PathBuf, proxies: Vec<PathBuf>) -> (u8, String, String) {
    let plugins = plugin_path("domain-default").unwrap();
    run(Command::ValidateConfig(ValidateConfigArgs {
        file,
        proxies,
        plugin_dir: plugins.parent().map(PathBuf::from),
        plugin_cache_dir: None,
        plugin_ca_file: None,
        no_plugins: false,
    }))
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
    let (code, out, err) = validate(
        sample("providers-config.yaml"),
        vec![sample("proxy_kvm2.yaml")],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.contains("valid: cluster \"prod-eu-1\": 2 host(s)"),
        "{out}"
    );
    assert!(out.contains("1 Proxy manifest(s) checked"), "{out}");
    assert!(
        out.contains("plugin settings checked: domain, vendorData"),
        "{out}"
    );
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
    let (code, out, err) = validate(file.clone(), vec![]);
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
    let (code, _, err) = validate(sample("providers-config.yaml"), vec![file]);
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
        validate(sample("providers-config.yaml"), vec![file])
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

/// Settings the config's shape allows but the plugin refuses are errors at their JSON
/// pointer: an unknown key (with the key it probably meant) by the plugin's schema, a
/// bad value by its `validate-settings`, and a Proxy's override by both.
#[test]
fn validate_config_refuses_settings_the_plugin_refuses_at_their_pointer() {
    let text = std::fs::read_to_string(sample("providers-config.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = |from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, text.replace(from, to)).unwrap();
        file
    };
    let (code, out, err) = validate(config("listenPort: 3128", "listenPrt: 3128"), vec![]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(
        err.contains(
            "kvm2.templates.vendorData.settings/listenPrt: unknown key \"listenPrt\"; did you mean `listenPort`?"
        ),
        "{err}"
    );
    let (code, _, err) = validate(config("- 10.0.0.0/8", "- 10.0.0.0/33"), vec![]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("kvm2.templates.vendorData.settings/allowedClientCidrs/0: "),
        "{err}"
    );
    let (code, _, err) = validate(config("settings: {}", "settings: {uefi: 3}"), vec![]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("kvm2.templates.domain.settings/uefi: "),
        "{err}"
    );

    let proxy = dir.path().join("proxy.yaml");
    let manifest = std::fs::read_to_string(sample("proxy_kvm2.yaml")).unwrap();
    std::fs::write(
        &proxy,
        format!("{manifest}  templateSettings:\n    vendorData: {{listenPort: 0}}\n"),
    )
    .unwrap();
    let (code, _, err) = validate(sample("providers-config.yaml"), vec![proxy.clone()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "{}: spec.templateSettings.vendorData.listenPort: 0 is less than the minimum of 1",
            proxy.display()
        )),
        "{err}"
    );
}

/// A plugin that cannot be had here is reported as not checked, never as valid, and the
/// config's own check still passes: a `path` inside the operator's image, a `url` that
/// is neither reachable nor cached. A `url` plugin in the operator's plugin cache is
/// checked without a download.
#[test]
fn validate_config_says_which_plugins_it_could_not_check() {
    use integration_tests::https::{HttpsServer, Reply};
    use sha2::Digest as _;

    let (code, out, err) = run(Command::ValidateConfig(ValidateConfigArgs {
        file: sample("providers-config.yaml"),
        proxies: vec![],
        plugin_dir: None,
        plugin_cache_dir: None,
        plugin_ca_file: None,
        no_plugins: false,
    }));
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("plugin settings checked"), "{out}");
    for field in ["domain", "vendorData"] {
        assert!(
            err.contains(&format!(
                "kvm2.templates.{field}: not checked: /usr/lib/egress-operator/plugins/"
            )),
            "{err}"
        );
    }
    assert!(err.contains("pass --plugin-dir DIR"), "{err}");

    let bytes = std::fs::read(plugin_path("domain-default").unwrap()).unwrap();
    let sha = hex::encode(sha2::Sha256::digest(&bytes));
    let server = HttpsServer::start(vec![("/domain.wasm".into(), Reply::Body(bytes))]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cache, file) = (
        dir.path().join("ca.pem"),
        dir.path().join("cache"),
        dir.path().join("c.yaml"),
    );
    std::fs::write(&ca, server.ca_pem()).unwrap();
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let text = std::fs::read_to_string(sample("providers-config.yaml"))
        .unwrap()
        .replace(
            "path: /usr/lib/egress-operator/plugins/domain-default.wasm",
            &format!("url: {}\n      sha256: {sha}", server.url("/domain.wasm")),
        )
        .replace("settings: {}", "settings: {uefi: 3}");
    std::fs::write(&file, text).unwrap();
    let with = |ca: Option<&PathBuf>, cache: Option<&PathBuf>| {
        run(Command::ValidateConfig(ValidateConfigArgs {
            file: file.clone(),
            proxies: vec![],
            plugin_dir: plugin_path("domain-default")
                .unwrap()
                .parent()
                .map(PathBuf::from),
            plugin_cache_dir: cache.cloned(),
            plugin_ca_file: ca.cloned(),
            no_plugins: false,
        }))
    };
    // Downloaded (and cached): its settings are checked and refused.
    let (code, _, err) = with(Some(&ca), Some(&cache));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("kvm2.templates.domain.settings/uefi: "),
        "{err}"
    );
    assert_eq!(server.requests(), 1);
    drop(server);
    // Gone from the network, still in the cache: checked all the same.
    let (code, _, err) = with(None, Some(&cache));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("kvm2.templates.domain.settings/uefi: "),
        "{err}"
    );
    // Neither reachable nor cached: not checked, and said so.
    let (code, out, err) = with(None, None);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("kvm2.templates.domain: not checked: https://127.0.0.1:"),
        "{err}"
    );
    assert!(err.contains("no --plugin-cache-dir was given"), "{err}");
    assert!(out.contains("plugin settings checked: vendorData"), "{out}");
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
