//! The monitoring component: promtool checks and unit-tests the alerts, every alert has a
//! severity, a summary, a description and a runbook page in the guide, and each one both
//! fires and stays quiet in the unit tests; the dashboard's queries parse.
//!
//! That the metrics and labels they read are ones the operator exports is checked against
//! the running operator in tests/tests/run_mode.rs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use integration_tests::harness::{Need, skip};
use integration_tests::monitoring::{self, Alert};

/// Runs promtool with `args` in `dir`; panics with its output when it fails.
fn promtool(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// The guide's runbook page for an alert, from its `runbook_url`.
fn runbook_page(alert: &Alert) -> std::path::PathBuf {
    let url = &alert.annotations["runbook_url"];
    let page = url
        .rsplit('/')
        .next()
        .and_then(|p| p.strip_suffix(".html"))
        .unwrap_or_else(|| panic!("{}: runbook_url {url} is not a page", alert.name));
    assert_eq!(
        page, alert.name,
        "{}: the runbook page is named after the alert",
        alert.name
    );
    monitoring::config_dir()
        .join("../docs/guide/src/runbooks")
        .join(format!("{page}.md"))
}

#[test]
fn alerts_are_checked_and_unit_tested_by_promtool() {
    if skip(&[Need::Promtool]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("alerts.yaml"),
        serde_yaml_ng::to_string(&monitoring::rule_file().unwrap()).unwrap(),
    )
    .unwrap();
    let tests = monitoring::prometheus_dir().join("prometheus-rule.test.yaml");
    std::fs::copy(&tests, dir.path().join("alerts.test.yaml")).unwrap();
    let alerts = monitoring::alerts().unwrap();
    let checked = promtool(dir.path(), &["check", "rules", "alerts.yaml"]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alerts.len())),
        "{checked}"
    );
    promtool(dir.path(), &["test", "rules", "alerts.test.yaml"]);

    // Each alert fires in one case and stays quiet in another.
    let cases: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&tests).unwrap()).unwrap();
    let mut seen: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for case in cases["tests"].as_sequence().unwrap() {
        for t in case["alert_rule_test"].as_sequence().unwrap() {
            let name = t["alertname"].as_str().unwrap().to_string();
            let fired = !t["exp_alerts"].as_sequence().unwrap().is_empty();
            let e = seen.entry(name).or_default();
            if fired {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
        }
    }
    for a in &alerts {
        let (fires, quiet) = seen.get(&a.name).copied().unwrap_or_default();
        assert!(
            fires > 0 && quiet > 0,
            "{}: the unit tests need a case where it fires ({fires}) and one where it does not ({quiet})",
            a.name
        );
    }
}

#[test]
fn every_alert_has_a_severity_a_text_and_a_runbook_page() {
    let alerts = monitoring::alerts().unwrap();
    assert!(alerts.len() >= 12, "{} alerts", alerts.len());
    let mut names = std::collections::BTreeSet::new();
    for a in &alerts {
        assert!(names.insert(a.name.clone()), "{} twice", a.name);
        let severity = a.labels.get("severity").map(String::as_str);
        assert!(
            matches!(severity, Some("critical" | "warning")),
            "{}: severity {severity:?}",
            a.name
        );
        for key in ["summary", "description", "runbook_url"] {
            assert!(
                a.annotations.get(key).is_some_and(|v| !v.trim().is_empty()),
                "{}: no {key}",
                a.name
            );
        }
        let page = runbook_page(a);
        let text = std::fs::read_to_string(&page)
            .unwrap_or_else(|e| panic!("{}: runbook {}: {e}", a.name, page.display()));
        for section in ["## Meaning", "## Diagnosis", "## Mitigation"] {
            assert!(
                text.contains(section),
                "{}: the runbook has no {section:?} section",
                a.name
            );
        }
    }
    // Alerts about an object name it: a label they group by reaches the summary.
    for a in &alerts {
        let u = monitoring::uses(&a.expr);
        for label in ["pool", "lease", "proxy", "target", "image"] {
            if u.grouping.contains(label) {
                assert!(
                    a.annotations["summary"].contains(&format!("$labels.{label}")),
                    "{}: groups by {label} but its summary does not name it",
                    a.name
                );
            }
        }
    }
}

#[test]
fn dashboard_queries_parse() {
    if skip(&[Need::Promtool]) {
        return;
    }
    let queries = monitoring::dashboard_queries().unwrap();
    assert!(queries.len() >= 10, "{} queries", queries.len());
    // promtool parses recording rules: one per panel query.
    let rules: Vec<serde_json::Value> = queries
        .iter()
        .map(|(id, expr)| serde_json::json!({"record": format!("dashboard:panel_{id}"), "expr": expr}))
        .collect();
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("dashboard.yaml"),
        serde_yaml_ng::to_string(&file).unwrap(),
    )
    .unwrap();
    let out = promtool(dir.path(), &["check", "rules", "dashboard.yaml"]);
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{out}"
    );
    // Each panel the issue asks for is there.
    let text =
        std::fs::read_to_string(monitoring::prometheus_dir().join("dashboard.json")).unwrap();
    for metric in [
        "egress_proxies",
        "egress_fleet_endpoints",
        "egress_fleet_endpoint_removal_seconds",
        "egress_fleet_leases",
        "egress_provider_call_duration_seconds_bucket{op=\\\"create\\\"}",
        "egress_provider_target_up",
        "egress_kube_requests_total",
    ] {
        assert!(
            text.contains(metric),
            "the dashboard has no panel on {metric}"
        );
    }
}

#[test]
fn a_broken_alert_fails_its_unit_test() {
    // The unit tests can fail: quieten one alert and promtool must say so.
    if skip(&[Need::Promtool]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = serde_yaml_ng::to_string(&monitoring::rule_file().unwrap()).unwrap();
    let broken = spec.replace(
        "egress_fleet_endpoints_held == 1",
        "egress_fleet_endpoints_held == 2",
    );
    assert_ne!(spec, broken, "the rule to break was not found");
    std::fs::write(dir.path().join("alerts.yaml"), broken).unwrap();
    std::fs::copy(
        monitoring::prometheus_dir().join("prometheus-rule.test.yaml"),
        dir.path().join("alerts.test.yaml"),
    )
    .unwrap();
    let out = Command::new("promtool")
        .args(["test", "rules", "alerts.test.yaml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("EgressEndpointsHeld"));
}
