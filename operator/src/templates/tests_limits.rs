//! Host-side limits against the hostile test plugin (`tests/plugins/hostile-domain`, built
//! by `make plugins` into `target/plugins/`): results refused before they are copied into
//! host memory, WASI resources and handles capped per store, settings issues capped in
//! what is lifted and in what is kept.

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::{Value, json};

use super::bindings::capped::{Capped, CappedList, Issue, lift_counter};
use super::*;
use crate::render::{self, Facts};

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

/// The hostile plugin in `mode`, with room for what the mode needs.
fn hostile(mode: &str, memory_mib: u32, timeout_millis: u32) -> TemplateConfig {
    TemplateConfig {
        path: Some(plugin("hostile-domain")),
        url: None,
        sha256: None,
        credentials_file: None,
        settings: json!({ "mode": mode }),
        overridable_settings: vec!["mode".into()],
        timeout_millis,
        max_memory_mib: memory_mib,
    }
}

fn engine() -> &'static TemplateEngine {
    static ENGINE: OnceLock<TemplateEngine> = OnceLock::new();
    ENGINE.get_or_init(|| TemplateEngine::new(None).unwrap())
}

/// The domain input of the sample config and Proxy.
fn input() -> DomainInput {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/samples");
    let config = crate::config::load_file(&root.join("providers-config.yaml")).unwrap();
    let proxy = crate::api::proxy::load_manifest(&root.join("proxy_kvm2.yaml"), &config).unwrap();
    render::inputs(
        &config,
        &proxy,
        None,
        &Facts::default(),
        "2026-01-01T00:00:00Z",
    )
    .unwrap()
    .domain
}

/// Runs `f` and returns its result with the plugin bytes it copied into host strings on
/// this thread (lifts run on the calling thread).
fn counting<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = lift_counter::total();
    let out = f();
    (out, lift_counter::total() - before)
}

#[test]
fn an_oversized_output_is_refused_before_a_byte_of_it_is_copied() {
    let input = input();
    // 256 MiB of memory and ten seconds: the plugin does build its 64 MiB string.
    let big = engine()
        .load_domain(&hostile("oversized-output", 256, 10_000))
        .unwrap();
    let (result, copied) = counting(|| big.render(&input));
    let err = result.unwrap_err();
    assert!(
        matches!(err.kind, TemplateErrorKind::OutputTooLarge { size, max }
            if size == 64 * 1024 * 1024 && max == check::DOMAIN_XML_MAX),
        "{err}"
    );
    assert_eq!(
        copied, 0,
        "the oversized output was copied into host memory"
    );

    // The same for a refusal message over its cap.
    let refusal = engine()
        .load_domain(&hostile("oversized-refusal", 64, 1_000))
        .unwrap();
    let (result, copied) = counting(|| refusal.render(&input));
    let err = result.unwrap_err();
    assert!(
        matches!(err.kind, TemplateErrorKind::RefusalTooLarge { size, max }
            if size == 1024 * 1024 && max == REFUSAL_MAX),
        "{err}"
    );
    assert_eq!(
        copied, 0,
        "the oversized refusal was copied into host memory"
    );

    // The count is real: a good render copies exactly its output, and still works.
    let good = engine().load_domain(&hostile("good", 64, 1_000)).unwrap();
    let (xml, copied) = counting(|| good.render(&input));
    let xml = xml.unwrap();
    assert_eq!(copied, xml.len());
}

#[test]
fn validate_settings_issues_are_lifted_sixteen_at_most_each_text_capped() {
    let schema_len = engine()
        .load_domain(&hostile("good", 64, 1_000))
        .unwrap()
        .settings_schema()
        .unwrap()
        .len();

    // 100,000 issues (about 2.5 MB): only sixteen are copied.
    let (result, copied) = counting(|| engine().load_domain(&hostile("many-issues", 64, 1_000)));
    let err = result.unwrap_err();
    let TemplateErrorKind::Settings { issues } = &err.kind else {
        panic!("not a settings refusal: {err}");
    };
    assert!(
        !issues.is_empty() && issues.len() <= MAX_SETTINGS_ISSUES,
        "{err}"
    );
    assert_eq!(issues[0].pointer, "/mode/0");
    let last = issues.last().unwrap();
    assert!(
        last.message
            .ends_with(&format!("(and {} more)", 100_000 - issues.len())),
        "{last}"
    );
    assert!(
        copied < schema_len + MAX_SETTINGS_ISSUES * 64,
        "copied {copied} bytes for sixteen short issues"
    );

    // One issue with a 1 MiB message and a 64 KiB pointer: neither is copied.
    let (result, copied) = counting(|| engine().load_domain(&hostile("long-issue", 64, 1_000)));
    let err = result.unwrap_err();
    let TemplateErrorKind::Settings { issues } = &err.kind else {
        panic!("not a settings refusal: {err}");
    };
    assert_eq!(issues.len(), 1, "{err}");
    assert!(
        issues[0]
            .message
            .contains("1048576 bytes, over the 4096-byte cap"),
        "{err}"
    );
    assert!(
        issues[0]
            .pointer
            .contains("65537 bytes, over the 4096-byte cap"),
        "{err}"
    );
    assert!(copied <= schema_len, "copied {copied} bytes");
}

#[test]
fn kept_issues_are_capped_per_text_in_number_and_in_total() {
    let issue = |n: usize| SettingsIssue {
        pointer: format!("/{}", "p".repeat(n)),
        message: "m".repeat(n),
    };
    // Each text cut short, marked, on a character boundary.
    let kept = keep_issues(vec![issue(10_000)], 1);
    assert_eq!(kept.len(), 1);
    assert!(kept[0].pointer.len() <= ISSUE_POINTER_KEPT + '…'.len_utf8());
    assert!(kept[0].message.len() <= ISSUE_MESSAGE_KEPT + '…'.len_utf8());
    assert!(kept[0].message.ends_with('…'));
    let kept = keep_issues(
        vec![SettingsIssue {
            pointer: String::new(),
            message: "é".repeat(1000),
        }],
        1,
    );
    assert!(kept[0].message.ends_with('…'));

    // Many short issues: the number is capped, the rest counted.
    let kept = keep_issues((0..100).map(|_| issue(4)).collect(), 1_000_000);
    assert_eq!(kept.len(), MAX_SETTINGS_ISSUES);
    assert!(
        kept[MAX_SETTINGS_ISSUES - 1]
            .message
            .ends_with(&format!("(and {} more)", 1_000_000 - MAX_SETTINGS_ISSUES))
    );

    // Many long issues: the total is capped before the number is.
    let kept = keep_issues((0..16).map(|_| issue(1000)).collect(), 16);
    let total: usize = kept.iter().map(|i| i.pointer.len() + i.message.len()).sum();
    assert!(kept.len() < MAX_SETTINGS_ISSUES);
    assert!(total <= ISSUES_TEXT_KEPT + 64, "{total}");
    assert!(kept.last().unwrap().message.contains("more)"));

    // Nothing over the caps is left alone.
    let kept = keep_issues(vec![issue(3)], 1);
    assert_eq!(kept, vec![issue(3)]);
}

#[test]
fn per_proxy_issues_are_capped_the_same_way() {
    let plugin = engine().load_domain(&hostile("good", 64, 1_000)).unwrap();
    let overrides: SettingsOverrides = serde_json::from_value(json!({"mode": "good"})).unwrap();
    let err = plugin
        .loaded
        .settings_for(Some(&overrides), |_, _| {
            Ok(Err(CappedList {
                items: vec![
                    Issue {
                        pointer: Capped::Text("/mode".into()),
                        message: Capped::Over { len: 5_000_000 },
                    };
                    MAX_SETTINGS_ISSUES
                ],
                total: 1_000_000,
            }))
        })
        .unwrap_err();
    let TemplateErrorKind::Overrides { issues } = &err.kind else {
        panic!("not an overrides refusal: {err}");
    };
    assert_eq!(issues.len(), MAX_SETTINGS_ISSUES, "{err}");
    assert_eq!(issues[0].path, "spec.templateSettings.domain.mode");
    assert!(
        issues[0]
            .message
            .contains("5000000 bytes, over the 4096-byte cap")
    );
    assert!(
        issues[MAX_SETTINGS_ISSUES - 1]
            .message
            .ends_with(&format!("(and {} more)", 1_000_000 - MAX_SETTINGS_ISSUES)),
        "{err}"
    );
}

#[test]
fn the_wasi_resource_table_is_capped_per_store() {
    let mut state = RenderState::new(1024 * 1024);
    for i in 0..sandbox::MAX_RESOURCES {
        assert!(!state.resources_full(), "full after {i} entries");
        wasmtime_wasi::WasiView::ctx(&mut state)
            .table
            .push(())
            .unwrap();
    }
    assert!(state.resources_full());
    assert!(matches!(
        wasmtime_wasi::WasiView::ctx(&mut state).table.push(()),
        Err(wasmtime::component::ResourceTableError::Full)
    ));
}

#[test]
fn every_store_carries_the_handle_and_hostcall_caps() {
    let plugin = engine().load_domain(&hostile("good", 64, 1_000)).unwrap();
    let store = plugin.loaded.store(Duration::from_secs(1)).unwrap();
    assert_eq!(
        store.max_component_handles(),
        sandbox::MAX_COMPONENT_HANDLES
    );
    assert_eq!(store.hostcall_fuel(), sandbox::HOSTCALL_FUEL);
}

#[test]
fn handles_held_without_end_fail_that_render_and_the_next_one_works() {
    let input = input();
    for mode in ["many-handles", "many-pollables"] {
        // Ten seconds: the caps stop it, not the clock.
        let plugin = engine().load_domain(&hostile(mode, 64, 10_000)).unwrap();
        let start = std::time::Instant::now();
        let err = plugin.render(&input).unwrap_err();
        assert!(
            matches!(
                err.kind,
                TemplateErrorKind::Limit {
                    limit: Limit::Resources
                }
            ),
            "{mode}: {err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{mode}: took {:?}",
            start.elapsed()
        );
        let good = engine().load_domain(&hostile("good", 64, 1_000)).unwrap();
        assert!(good.render(&input).is_ok());
    }
}

#[test]
fn the_hostile_plugin_schema_loads_as_an_ordinary_one() {
    // The hostile plugin exports its own `settings-schema` (not the SDK macro's): with the
    // unpatched component it is the ordinary generated one, which the rules accept.
    let plugin = engine().load_domain(&hostile("good", 64, 1_000)).unwrap();
    let schema: Value = serde_json::from_str(&plugin.settings_schema().unwrap()).unwrap();
    assert!(schema["properties"]["mode"].is_object(), "{schema}");
}

#[test]
fn the_default_plugins_schemas_sit_far_within_the_caps() {
    let cfg = |name: &str| TemplateConfig {
        path: Some(plugin(name)),
        settings: json!({}),
        overridable_settings: Vec::new(),
        ..hostile("good", 64, 1_000)
    };
    let domain = engine().load_domain(&cfg("domain-default")).unwrap();
    let vendor = engine()
        .load_vendor_data(&cfg("vendor-data-default"))
        .unwrap();
    for text in [
        domain.settings_schema().unwrap(),
        vendor.settings_schema().unwrap(),
    ] {
        let compiled = schema::compile(&text).unwrap();
        assert!(text.len() * 16 < schema::SCHEMA_MAX_BYTES, "{}", text.len());
        assert!(
            compiled.expanded() * 4 < schema::SCHEMA_MAX_EXPANDED,
            "{} expanded nodes",
            compiled.expanded()
        );
    }
}
