//! The template host against real components: the default plugins and a hostile corpus.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::sync::mpsc;
use std::time::Duration;

use egress_operator::api::proxy;
use egress_operator::config::{self, TemplateConfig};
use egress_operator::render::{self, Facts};
use egress_operator::templates::{
    self, CacheOutcome, DomainInput, Limit, TemplateEngine, TemplateError, TemplateErrorKind, check,
};
use integration_tests::{plugin_path, workspace_root};
use serde_json::json;

/// Generous hang guard: a render that never returns fails the test instead of hanging CI.
const HANG_GUARD: Duration = Duration::from_secs(60);
const CREATED_AT: &str = "2026-01-01T00:00:00Z";

fn template(plugin: &str, settings: serde_json::Value) -> TemplateConfig {
    TemplateConfig {
        path: Some(plugin_path(plugin).unwrap().display().to_string()),
        url: None,
        sha256: None,
        credentials_file: None,
        settings,
        overridable_settings: Vec::new(),
        timeout_millis: 250,
        max_memory_mib: 64,
    }
}

fn sample_inputs() -> render::Inputs {
    let root = workspace_root().join("config/samples");
    let config = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let proxy = proxy::load_manifest(&root.join("proxy_kvm2.yaml"), &config).unwrap();
    render::inputs(&config, &proxy, None, &Facts::default(), CREATED_AT).unwrap()
}

fn sample_templates() -> (TemplateConfig, TemplateConfig) {
    let root = workspace_root().join("config/samples");
    let config = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let mut t = config.kvm2.templates.clone();
    t.domain.path = Some(plugin_path("domain-default").unwrap().display().to_string());
    t.vendor_data.path = Some(
        plugin_path("vendor-data-default")
            .unwrap()
            .display()
            .to_string(),
    );
    (t.domain, t.vendor_data)
}

/// Runs `f` on another thread and fails if it does not finish within the hang guard.
fn guarded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(HANG_GUARD)
        .expect("render hung past the hang guard")
}

fn check_snapshot(name: &str, actual: &str) {
    let path = workspace_root().join("tests/snapshots").join(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        expected == actual,
        "{} differs from the render; if the change is intended, rerun with UPDATE_SNAPSHOTS=1\n--- render ---\n{actual}",
        path.display()
    );
}

#[test]
fn default_plugins_render_the_samples_deterministically_and_match_snapshots() {
    let engine = TemplateEngine::new(None).unwrap();
    let (d, v) = sample_templates();
    let domain = engine.load_domain(&d).unwrap();
    let vendor = engine.load_vendor_data(&v).unwrap();
    let inputs = sample_inputs();

    let xml = domain.render(&inputs.domain).unwrap();
    assert_eq!(
        xml,
        domain.render(&inputs.domain).unwrap(),
        "two renders differ"
    );
    check_snapshot("domain-default.xml", &xml);

    let vd = vendor.render(&inputs.vendor_data).unwrap();
    assert_eq!(
        vd,
        vendor.render(&inputs.vendor_data).unwrap(),
        "two renders differ"
    );
    check_snapshot("vendor-data-default.mime", &vd);
    // A MIME multipart whose essential part is a shell script (user-data cannot drop it).
    assert!(vd.starts_with("Content-Type: multipart/mixed;"), "{vd}");
    assert!(vd.contains("Content-Type: text/x-shellscript"), "{vd}");

    // A fresh engine gives the same bytes too: nothing depends on process state.
    let other = TemplateEngine::new(None).unwrap();
    assert_eq!(
        other
            .load_domain(&d)
            .unwrap()
            .render(&inputs.domain)
            .unwrap(),
        xml
    );
}

/// The SDK's "A complete plugin" example is `plugins/sdk-example` verbatim (its docs
/// include the file); built as a component, it passes every check the operator runs on a
/// render, for BIOS and UEFI machine types, with and without an assigned MAC, and its
/// setting is validated by the operator as by the plugin.
#[test]
fn the_sdk_example_renders_through_the_operators_checks() {
    use egress_operator::templates::Firmware;
    use egress_operator::templates::check::HostPolicy;

    let sdk_doc =
        std::fs::read_to_string(workspace_root().join("templates-sdk/src/lib.rs")).unwrap();
    assert!(
        sdk_doc.contains("include_str!(\"../../plugins/sdk-example/src/lib.rs\")"),
        "the SDK's example must be the plugin's source"
    );
    let engine = TemplateEngine::new(None).unwrap();
    let (mut d, _) = sample_templates();
    d.path = Some(plugin_path("sdk-example").unwrap().display().to_string());
    d.settings = json!({"diskSerial": "root-0001"});
    let plugin = engine.load_domain(&d).unwrap();
    let inputs = sample_inputs();
    let policy = HostPolicy::for_host(&inputs.host);
    for firmware in [Firmware::Bios, Firmware::Efi] {
        for mac in [inputs.domain.mac.clone(), None] {
            let mut input = inputs.domain.clone();
            input.firmware = firmware;
            input.mac = mac;
            let xml = plugin.render_on(&input, None, &policy);
            assert!(xml.is_ok(), "{firmware:?}: {xml:?}");
            assert!(xml.unwrap().contains("<serial>root-0001</serial>"));
        }
    }
    d.settings = json!({"diskSerial": "x".repeat(21)});
    let refused = engine.load_domain(&d).unwrap_err().to_string();
    assert!(
        refused.contains("/diskSerial: at most 20 characters"),
        "{refused}"
    );
}

/// `plugins/README.md` documents both default plugins' settings with tables generated
/// from the schemas the plugins export (what the operator checks settings against), so
/// the page cannot drift from what is accepted. `UPDATE_SNAPSHOTS=1` rewrites them.
#[test]
fn the_default_plugins_settings_are_documented_from_their_schemas() {
    use egress_operator::templates::settings_doc;

    let engine = TemplateEngine::new(None).unwrap();
    let (d, v) = sample_templates();
    let tables = [
        (
            "domain-default",
            engine.load_domain(&d).unwrap().settings_schema().unwrap(),
        ),
        (
            "vendor-data-default",
            engine
                .load_vendor_data(&v)
                .unwrap()
                .settings_schema()
                .unwrap(),
        ),
    ];
    let path = workspace_root().join("plugins/README.md");
    let mut page = std::fs::read_to_string(&path).unwrap();
    let mut stale = Vec::new();
    for (name, schema) in tables {
        let table = settings_doc::markdown(&schema).unwrap();
        let begin = format!("<!-- BEGIN generated settings of {name} -->\n");
        let end = format!("<!-- END generated settings of {name} -->");
        let (Some(from), Some(to)) = (page.find(&begin), page.find(&end)) else {
            panic!("plugins/README.md lacks the markers {begin:?} ... {end:?}");
        };
        let from = from + begin.len();
        if page[from..to] != table {
            stale.push(name);
            page.replace_range(from..to, &table);
        }
    }
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &page).unwrap();
    } else {
        assert!(
            stale.is_empty(),
            "plugins/README.md's settings tables of {stale:?} are stale: rerun with UPDATE_SNAPSHOTS=1"
        );
    }
}

#[test]
fn default_domain_xml_passes_libvirts_schema() {
    let Ok(validator) = which("virt-xml-validate") else {
        integration_tests::harness::cannot_run(
            "virt-xml-validate is not installed (make setup installs libvirt-clients)",
        );
        return;
    };
    let engine = TemplateEngine::new(None).unwrap();
    let (d, _) = sample_templates();
    let domain = engine.load_domain(&d).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (kvm, efi) in [(false, false), (true, false), (true, true)] {
        let mut input = sample_inputs().domain;
        input.host.kvm = kvm;
        if efi {
            input.firmware = egress_operator::templates::Firmware::Efi;
        }
        let xml = domain.render(&input).unwrap();
        let file = dir.path().join(format!("d-{kvm}-{efi}.xml"));
        std::fs::write(&file, &xml).unwrap();
        let out = std::process::Command::new(&validator)
            .arg(&file)
            .arg("domain")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "virt-xml-validate refused (kvm={kvm}, efi={efi}): {}\n{xml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn which(bin: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(bin))
        .find(|p| p.exists())
        .ok_or(())
}

fn hostile(mode: &str) -> TemplateConfig {
    template("hostile-domain", json!({ "mode": mode }))
}

fn render_hostile(
    engine: &TemplateEngine,
    cfg: &TemplateConfig,
    input: &DomainInput,
) -> Result<String, TemplateError> {
    engine.load_domain(cfg)?.render(input)
}

#[test]
fn hostile_corpus_is_refused_case_by_case_and_the_host_survives() {
    // Compiled once, then loaded from the code cache: the cases cost their runs, not a
    // compile each.
    let cache = tempfile::tempdir().unwrap();
    let engine = std::sync::Arc::new(TemplateEngine::new(Some(cache.path())).unwrap());
    let input = sample_inputs().domain;

    type Expect = fn(&TemplateErrorKind) -> bool;
    let cases: Vec<(&str, TemplateConfig, Expect)> = vec![
        (
            "endless loop hits the deadline",
            hostile("endless-loop"),
            |k| {
                matches!(
                    k,
                    TemplateErrorKind::Limit {
                        limit: Limit::Timeout
                    }
                )
            },
        ),
        (
            "endless loop with a long deadline runs out of fuel",
            TemplateConfig {
                timeout_millis: 10_000,
                ..hostile("endless-loop")
            },
            |k| matches!(k, TemplateErrorKind::Limit { limit: Limit::Fuel }),
        ),
        ("memory bomb", hostile("memory-bomb"), |k| {
            matches!(
                k,
                TemplateErrorKind::Limit {
                    limit: Limit::Memory
                }
            )
        }),
        (
            "deep recursion",
            hostile("deep-recursion"),
            |k| matches!(k, TemplateErrorKind::Trap(m) if m.contains("stack")),
        ),
        ("100 MB output", hostile("huge-output"), |k| {
            matches!(
                k,
                TemplateErrorKind::Limit {
                    limit: Limit::Memory
                }
            )
        }),
        ("1 MB output", hostile("big-output"), |k| {
            matches!(k, TemplateErrorKind::OutputTooLarge { .. })
        }),
        ("invalid XML", hostile("invalid-xml"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "well-formed",
                    ..
                }
            )
        }),
        ("renamed domain", hostile("rename"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "name-unchanged",
                    ..
                }
            )
        }),
        ("dropped mark", hostile("drop-mark"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "metadata-mark",
                    ..
                }
            )
        }),
        ("edited mark", hostile("edit-mark"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "metadata-mark",
                    ..
                }
            )
        }),
        (
            "hostdev",
            hostile("hostdev"),
            // The deny-list's rule, or the allow-list's that replaces it (issue 11).
            |k| matches!(k, TemplateErrorKind::InvalidOutput { rule: "no-host-resources" | "allow-list", detail } if detail.contains("hostdev")),
        ),
        ("file-backed disk", hostile("file-disk"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "disk-volume-only" | "value",
                    detail,
                } if detail.contains("disk")
            )
        }),
        ("qemu:commandline", hostile("qemu-commandline"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "no-qemu-passthrough" | "namespaces",
                    detail,
                } if detail.contains("qemu")
            )
        }),
        ("second bridge", hostile("second-bridge"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "interface-bridge-only",
                    ..
                }
            )
        }),
        ("file serial", hostile("file-serial"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "no-host-chardev" | "value",
                    detail,
                } if detail.contains("serial")
            )
        }),
        ("doctype", hostile("doctype"), |k| {
            matches!(
                k,
                TemplateErrorKind::InvalidOutput {
                    rule: "no-doctype",
                    ..
                }
            )
        }),
        ("panic", hostile("panic"), |k| {
            matches!(k, TemplateErrorKind::Trap(_))
        }),
        ("exit", hostile("exit"), |k| {
            matches!(k, TemplateErrorKind::Exit(_))
        }),
        ("log flood", hostile("print-flood"), |k| {
            matches!(k, TemplateErrorKind::Limit { limit: Limit::Log })
        }),
        (
            "settings that fail the schema",
            template("hostile-domain", json!({ "mode": 42 })),
            |k| matches!(k, TemplateErrorKind::Settings { issues } if issues[0].pointer == "/mode"),
        ),
        (
            "settings with an unknown key",
            template("hostile-domain", json!({ "mode": "good", "extra": 1 })),
            |k| matches!(k, TemplateErrorKind::Settings { .. }),
        ),
        (
            "settings that fail validate-settings",
            hostile("reject-settings"),
            |k| matches!(k, TemplateErrorKind::Settings { issues } if issues[0].pointer == "/mode" && issues[0].message.contains("refused by validate-settings")),
        ),
        (
            "filesystem import",
            template("hostile-fs", json!({})),
            |k| matches!(k, TemplateErrorKind::ForbiddenImport { imports } if imports.iter().any(|i| i.starts_with("wasi:filesystem/types@"))),
        ),
        (
            "vendor-data plugin configured as domain",
            template("vendor-data-default", json!({})),
            |k| matches!(k, TemplateErrorKind::Abi(m) if m.contains("is a vendor-data plugin")),
        ),
        (
            "sha256 mismatch",
            TemplateConfig {
                sha256: Some("0".repeat(64)),
                ..hostile("good")
            },
            |k| matches!(k, TemplateErrorKind::Sha256Mismatch { .. }),
        ),
        // A long deadline: the handle caps must stop these, not the clock.
        (
            "stdout handles never dropped",
            TemplateConfig {
                timeout_millis: 10_000,
                ..hostile("many-handles")
            },
            |k| {
                matches!(
                    k,
                    TemplateErrorKind::Limit {
                        limit: Limit::Resources
                    }
                )
            },
        ),
        (
            "pollables never dropped",
            TemplateConfig {
                timeout_millis: 10_000,
                ..hostile("many-pollables")
            },
            |k| {
                matches!(
                    k,
                    TemplateErrorKind::Limit {
                        limit: Limit::Resources
                    }
                )
            },
        ),
        // Memory and time to build 64 MiB: refused by its declared length, not a limit.
        (
            "64 MiB output within the memory cap",
            TemplateConfig {
                timeout_millis: 10_000,
                max_memory_mib: 256,
                ..hostile("oversized-output")
            },
            |k| {
                matches!(
                    k,
                    TemplateErrorKind::OutputTooLarge { size, max }
                        if *size == 64 * 1024 * 1024 && *max == check::DOMAIN_XML_MAX
                )
            },
        ),
        ("1 MiB refusal message", hostile("oversized-refusal"), |k| {
            matches!(
                k,
                TemplateErrorKind::RefusalTooLarge { size, max }
                    if *size == 1024 * 1024 && *max == templates::REFUSAL_MAX
            )
        }),
        (
            "100,000 validate-settings issues",
            hostile("many-issues"),
            |k| {
                matches!(k, TemplateErrorKind::Settings { issues }
                if !issues.is_empty()
                    && issues.len() <= templates::MAX_SETTINGS_ISSUES
                    && issues[0].pointer == "/mode/0"
                    && issues.last().is_some_and(|i| i.message.ends_with(
                        &format!("(and {} more)", 100_000 - issues.len())
                    )))
            },
        ),
        (
            "a 1 MiB validate-settings message and 64 KiB pointer",
            hostile("long-issue"),
            |k| {
                matches!(k, TemplateErrorKind::Settings { issues }
                    if issues.len() == 1
                        && issues[0].pointer.contains("65537 bytes, over the 4096-byte cap")
                        && issues[0].message.contains("1048576 bytes, over the 4096-byte cap"))
            },
        ),
    ];

    // Every case runs, and every wrong outcome is reported at once.
    let mut wrong = Vec::new();
    for (name, cfg, expect) in cases {
        let (e, i) = (engine.clone(), input.clone());
        let result = guarded(move || render_hostile(&e, &cfg, &i));
        match result {
            Ok(out) => wrong.push(format!(
                "{name}: rendered instead of failing ({} bytes)",
                out.len()
            )),
            Err(err) => {
                let text = err.to_string();
                if !expect(&err.kind) {
                    wrong.push(format!("{name}: wrong reason: {err}"));
                } else if !err.plugin.starts_with("domain:") {
                    wrong.push(format!("{name}: error does not name the plugin: {err}"));
                } else if text.len() >= 4096 {
                    wrong.push(format!("{name}: message too long ({} bytes)", text.len()));
                }
            }
        }
        // The same engine still renders a good plugin after every hostile case.
        let xml = render_hostile(&engine, &hostile("good"), &input)
            .unwrap_or_else(|e| panic!("after {name}: good plugin failed: {e}"));
        assert!(xml.contains(&input.metadata_mark));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A copy of the hostile plugin whose `settings-schema` returns the schema `mode` names
/// (see `SCHEMA_MODE` in the plugin): the mode's bytes are patched in place.
fn hostile_with_schema(dir: &std::path::Path, mode: &str) -> TemplateConfig {
    const PREFIX: &[u8] = b"egress-hostile-schema-mode:";
    const FIELD: usize = 16;
    let mut bytes = std::fs::read(plugin_path("hostile-domain").unwrap()).unwrap();
    let found: Vec<usize> = bytes
        .windows(PREFIX.len())
        .enumerate()
        .filter(|(_, w)| *w == PREFIX)
        .map(|(i, _)| i + PREFIX.len())
        .collect();
    assert_eq!(
        found.len(),
        1,
        "the schema mode marker must be in the component once"
    );
    assert!(mode.len() <= FIELD);
    let field = format!("{mode:_<FIELD$}");
    bytes[found[0]..found[0] + FIELD].copy_from_slice(field.as_bytes());
    let file = dir.join(format!("hostile-schema-{mode}.wasm"));
    std::fs::write(&file, bytes).unwrap();
    TemplateConfig {
        path: Some(file.display().to_string()),
        ..hostile("good")
    }
}

#[test]
fn hostile_settings_schemas_are_refused_at_load_naming_the_plugin_and_the_rule() {
    let engine = std::sync::Arc::new(TemplateEngine::new(None).unwrap());
    let input = sample_inputs().domain;
    let dir = tempfile::tempdir().unwrap();

    // The patched copy with the ordinary schema loads and renders: what the cases below
    // change is only the schema.
    let ordinary = hostile_with_schema(dir.path(), "ordinary");
    let plugin = engine.load_domain(&ordinary).unwrap();
    assert!(plugin.settings_schema().unwrap().contains("\"mode\""));
    assert!(plugin.render(&input).is_ok());

    for (mode, rule, detail) in [
        ("deep", "schema-depth", "more than 32 deep"),
        ("huge", "schema-size", "at most 262144 are read"),
        (
            "remote-ref",
            "schema-ref",
            "https://schemas.example.org/settings.json",
        ),
        ("bad-pattern", "schema-pattern", "linear-time regex engine"),
        ("ref-bomb", "schema-expansion", "every $ref expanded"),
        ("recursive", "schema-recursive-ref", "refers to itself"),
    ] {
        let cfg = hostile_with_schema(dir.path(), mode);
        let source = cfg.path.clone().unwrap();
        let e = engine.clone();
        let err = guarded(move || e.load_domain(&cfg).map(|_| ()))
            .expect_err(&format!("{mode}: the schema was accepted"));
        assert!(
            matches!(&err.kind, TemplateErrorKind::SchemaRefused { rule: r, detail: d }
                if *r == rule && d.contains(detail)),
            "{mode}: wrong reason: {err}"
        );
        assert_eq!(err.plugin, format!("domain:{source}"), "{mode}");
        let text = err.to_string();
        assert!(text.contains(rule) && text.contains(&source), "{text}");
        assert!(text.len() < 4096, "{mode}: message too long: {text}");
        // The same engine keeps loading and rendering other plugins.
        let xml = render_hostile(&engine, &hostile("good"), &input)
            .unwrap_or_else(|e| panic!("after {mode}: good plugin failed: {e}"));
        assert!(xml.contains(&input.metadata_mark));
    }
}

#[test]
fn not_a_component_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("junk.wasm");
    std::fs::write(&file, b"\0asm not really").unwrap();
    let cfg = TemplateConfig {
        path: Some(file.display().to_string()),
        ..hostile("good")
    };
    let err = TemplateEngine::new(None)
        .unwrap()
        .load_domain(&cfg)
        .unwrap_err();
    assert!(matches!(err.kind, TemplateErrorKind::Compile(_)), "{err}");
    let missing = TemplateConfig {
        path: Some("/nonexistent/p.wasm".into()),
        ..hostile("good")
    };
    let err = TemplateEngine::new(None)
        .unwrap()
        .load_domain(&missing)
        .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/p.wasm"), "{err}");
}

#[test]
fn compiled_code_cache_hits_and_treats_bad_entries_as_misses() {
    let dir = tempfile::tempdir().unwrap();
    let (d, _) = sample_templates();
    let input = sample_inputs().domain;

    let first = TemplateEngine::new(Some(dir.path())).unwrap();
    let a = first.load_domain(&d).unwrap();
    assert_eq!(a.cache_outcome(), CacheOutcome::Miss);
    let expected = a.render(&input).unwrap();

    let second = TemplateEngine::new(Some(dir.path())).unwrap();
    let b = second.load_domain(&d).unwrap();
    assert_eq!(b.cache_outcome(), CacheOutcome::Hit);
    assert_eq!(b.render(&input).unwrap(), expected);

    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert!(
        entry
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(a.sha256())
    );

    // A flipped byte in the payload: detected by the digest, a miss, then rewritten.
    let mut bytes = std::fs::read(entry).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(entry, &bytes).unwrap();
    let third = TemplateEngine::new(Some(dir.path())).unwrap();
    let c = third.load_domain(&d).unwrap();
    assert_eq!(c.cache_outcome(), CacheOutcome::Miss);
    assert_eq!(c.render(&input).unwrap(), expected);
    assert_eq!(
        TemplateEngine::new(Some(dir.path()))
            .unwrap()
            .load_domain(&d)
            .unwrap()
            .cache_outcome(),
        CacheOutcome::Hit,
        "the corrupt entry was not rewritten"
    );

    // Truncated and empty entries are misses too.
    for len in [10, 0] {
        let bytes = std::fs::read(entry).unwrap();
        std::fs::write(entry, &bytes[..len.min(bytes.len())]).unwrap();
        let e = TemplateEngine::new(Some(dir.path())).unwrap();
        assert_eq!(
            e.load_domain(&d).unwrap().cache_outcome(),
            CacheOutcome::Miss
        );
    }
}

mod download {
    use super::*;
    use egress_operator::templates::EngineOptions;
    use integration_tests::https::{HttpsServer, Reply};
    use sha2::{Digest, Sha256};

    fn engine(server: &HttpsServer, cache: Option<&std::path::Path>) -> TemplateEngine {
        TemplateEngine::with_options(&EngineOptions {
            cache_dir: cache.map(std::path::Path::to_path_buf),
            download_ca_pem: Some(server.ca_pem().as_bytes().to_vec()),
        })
        .unwrap()
    }

    fn url_template(url: String, sha256: &str) -> TemplateConfig {
        TemplateConfig {
            path: None,
            url: Some(url),
            sha256: Some(sha256.to_string()),
            credentials_file: None,
            settings: json!({}),
            overridable_settings: Vec::new(),
            timeout_millis: 250,
            max_memory_mib: 64,
        }
    }

    #[test]
    fn https_plugin_is_verified_then_cached_by_digest() {
        let bytes = std::fs::read(plugin_path("domain-default").unwrap()).unwrap();
        let sha = hex::encode(Sha256::digest(&bytes));
        let server = HttpsServer::start(vec![
            ("/domain.wasm".into(), Reply::Body(bytes.clone())),
            ("/moved".into(), Reply::Redirect("/domain.wasm".into())),
            (
                "/to-http".into(),
                Reply::Redirect("http://127.0.0.1:1/domain.wasm".into()),
            ),
            ("/loop".into(), Reply::Redirect("/loop".into())),
        ])
        .unwrap();
        let input = sample_inputs().domain;
        let dir = tempfile::tempdir().unwrap();

        let e = engine(&server, Some(dir.path()));
        let plugin = e
            .load_domain(&url_template(server.url("/domain.wasm"), &sha))
            .unwrap();
        assert_eq!(plugin.cache_outcome(), CacheOutcome::Miss);
        assert!(plugin.render(&input).is_ok());
        assert_eq!(server.requests(), 1);

        // The pinned digest is in the cache: no download at all.
        let again = engine(&server, Some(dir.path()))
            .load_domain(&url_template(server.url("/domain.wasm"), &sha))
            .unwrap();
        assert_eq!(again.cache_outcome(), CacheOutcome::Hit);
        assert_eq!(server.requests(), 1);

        // A redirect within https is followed.
        let moved = engine(&server, None).load_domain(&url_template(server.url("/moved"), &sha));
        assert!(moved.is_ok(), "{moved:?}");

        type Expect = fn(&TemplateErrorKind) -> bool;
        let cases: Vec<(&str, String, String, Expect)> = vec![
            (
                "wrong digest",
                server.url("/domain.wasm"),
                "0".repeat(64),
                |k| matches!(k, TemplateErrorKind::Sha256Mismatch { .. }),
            ),
            (
                "404",
                server.url("/missing"),
                sha.clone(),
                |k| matches!(k, TemplateErrorKind::Download { reason, .. } if reason.contains("404")),
            ),
            (
                "redirect to http",
                server.url("/to-http"),
                sha.clone(),
                |k| matches!(k, TemplateErrorKind::Download { reason, .. } if reason.contains("https")),
            ),
            (
                "redirect loop",
                server.url("/loop"),
                sha.clone(),
                |k| matches!(k, TemplateErrorKind::Download { reason, .. } if reason.contains("redirects")),
            ),
        ];
        for (name, url, digest, expect) in cases {
            let err = engine(&server, None)
                .load_domain(&url_template(url, &digest))
                .unwrap_err();
            assert!(expect(&err.kind), "{name}: {err}");
        }

        // An untrusted certificate is refused.
        let strict = TemplateEngine::new(None).unwrap();
        let err = strict
            .load_domain(&url_template(server.url("/domain.wasm"), &sha))
            .unwrap_err();
        assert!(
            matches!(err.kind, TemplateErrorKind::Download { .. }),
            "{err}"
        );
    }
}

#[test]
fn a_bad_plugin_marks_only_itself_unhealthy() {
    use egress_operator::Classified;
    use egress_operator::config::TemplatesConfig;
    use egress_operator::templates::TemplateSet;

    let engine = TemplateEngine::new(None).unwrap();
    let (good_domain, vendor) = sample_templates();
    let broken = TemplatesConfig {
        domain: template("hostile-domain", json!({ "mode": "no-such-mode" })),
        vendor_data: vendor.clone(),
    };
    let set = TemplateSet::load(&engine, &broken);
    assert!(!set.is_healthy());
    let err = set.domain().unwrap_err();
    assert!(
        err.reason.contains("settings refused") && err.reason.contains("/mode"),
        "{err}"
    );
    assert_eq!(err.class(), egress_operator::ErrorClass::Permanent);
    let health = set.health();
    assert!(health[0].problem.is_some());
    assert_eq!(health[1].problem, None);
    // The healthy plugin still renders.
    assert!(
        set.vendor_data()
            .unwrap()
            .render(&sample_inputs().vendor_data)
            .is_ok()
    );

    let fixed = TemplateSet::load(
        &engine,
        &TemplatesConfig {
            domain: good_domain,
            vendor_data: vendor,
        },
    );
    assert!(fixed.is_healthy());
}

/// `egress-operator render` merges a manifest's `spec.templateSettings` as the operator
/// would, and refuses what the operator would refuse.
#[test]
fn render_command_honours_a_manifests_settings_overrides() {
    use egress_operator::cli::{Command, RenderArgs, execute};

    let root = workspace_root().join("config/samples");
    let proxy = std::fs::read_to_string(root.join("proxy_kvm2.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let render_with = |overrides: &str| -> (u8, String, String) {
        let text = format!("{proxy}  templateSettings:\n    vendorData: {overrides}\n");
        let file = dir.path().join("proxy.yaml");
        std::fs::write(&file, text).unwrap();
        let args = RenderArgs {
            config: root.join("providers-config.yaml"),
            proxy: file,
            host: None,
            out: None,
            plugin_dir: Some(
                plugin_path("domain-default")
                    .unwrap()
                    .parent()
                    .unwrap()
                    .into(),
            ),
            cache_dir: None,
            plugin_ca_file: None,
            kvm: false,
            arch: "x86_64".into(),
            libvirt_version: "9.0.0".into(),
            host_cpus: 2,
            numa_nodes: 1,
            created_at: Some(CREATED_AT.into()),
        };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = execute(Command::Render(args), &mut out, &mut err);
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    };

    // The sample config lists listenPort as overridable.
    let (code, out, err) = render_with("{listenPort: 8888}");
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.contains("Port 8888") && !out.contains("Port 3128"),
        "{out}"
    );

    // It does not list maxClients: refused when the manifest is checked.
    let (code, out, err) = render_with("{maxClients: 5}");
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(
        err.contains("spec.templateSettings.vendorData.maxClients: is not overridable"),
        "{err}"
    );

    // A listed key with a value the plugin's schema refuses: refused at render.
    let (code, out, err) = render_with("{listenPort: 70000}");
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(
        err.contains("spec.templateSettings.vendorData.listenPort: 70000"),
        "{err}"
    );
}
