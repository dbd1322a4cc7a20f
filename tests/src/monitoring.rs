//! The monitoring component (`config/prometheus`) as tests read it: its alerts and the
//! dashboard's queries, the metric names and labels those use, and a check of them against
//! what a running operator exports on `/metrics`.
//!
//! The metric references are read by a small PromQL scanner, not a full parser: every
//! metric the operator exports starts with `egress_`, and no PromQL function, keyword or
//! label we use does, so an identifier with that prefix is a metric. Label names come from
//! a selector's matchers and from `by`, `without`, `on`, `ignoring`, `group_left` and
//! `group_right` lists. promtool checks the queries' syntax beside this.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Labels Prometheus itself puts on every scraped series (the PodMonitor's target labels),
/// and `le` of histogram buckets: a query may use them on any metric.
const SCRAPE_LABELS: &[&str] = &["namespace", "pod", "job", "instance", "container"];

/// `config/` of the repository.
pub fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config")
}

/// `config/prometheus/`.
pub fn prometheus_dir() -> PathBuf {
    config_dir().join("prometheus")
}

/// One alerting rule of the PrometheusRule.
#[derive(Debug, Clone)]
pub struct Alert {
    /// `alert:`.
    pub name: String,
    /// `expr:`.
    pub expr: String,
    /// `labels:`.
    pub labels: BTreeMap<String, String>,
    /// `annotations:`.
    pub annotations: BTreeMap<String, String>,
}

/// The PrometheusRule's `spec` (a rule file's `groups:`), as YAML.
pub fn rule_file() -> Result<serde_yaml_ng::Value> {
    let path = prometheus_dir().join("prometheus-rule.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text)?;
    let spec = doc
        .get("spec")
        .cloned()
        .context("prometheus-rule.yaml has no spec")?;
    Ok(spec)
}

fn string_map(v: Option<&serde_yaml_ng::Value>) -> BTreeMap<String, String> {
    v.and_then(|v| v.as_mapping())
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// Every alert of the PrometheusRule.
pub fn alerts() -> Result<Vec<Alert>> {
    let spec = rule_file()?;
    let mut out = Vec::new();
    for group in spec["groups"].as_sequence().context("spec.groups")? {
        for rule in group["rules"].as_sequence().context("groups[].rules")? {
            let Some(name) = rule.get("alert").and_then(|a| a.as_str()) else {
                continue;
            };
            out.push(Alert {
                name: name.to_string(),
                expr: rule["expr"].as_str().context("expr")?.to_string(),
                labels: string_map(rule.get("labels")),
                annotations: string_map(rule.get("annotations")),
            });
        }
    }
    Ok(out)
}

/// The dashboard's queries as (`panel id` + `refId`, expression), with Grafana's variables
/// replaced by what they stand for at query time (`$__rate_interval` a range, `$namespace`
/// the "All" regex), so promtool can parse them.
pub fn dashboard_queries() -> Result<Vec<(String, String)>> {
    let path = prometheus_dir().join("dashboard.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let dash: serde_json::Value = serde_json::from_str(&text)?;
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().context("panels")? {
        let id = &panel["id"];
        for target in panel["targets"].as_array().context("panels[].targets")? {
            let expr = target["expr"].as_str().context("targets[].expr")?;
            let expr = expr
                .replace("$__rate_interval", "5m")
                .replace("$namespace", ".*");
            if expr.contains('$') {
                bail!("panel {id}: a variable the check does not know: {expr}");
            }
            out.push((
                format!("{id}{}", target["refId"].as_str().unwrap_or("")),
                expr,
            ));
        }
    }
    Ok(out)
}

/// A metric an expression reads, and the labels its selector matches on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The series name as written (`egress_gc_sweeps_total`).
    pub name: String,
    /// Label names of its matchers.
    pub labels: Vec<String>,
}

/// What an expression reads: its `egress_` selectors, and the labels it groups or joins on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Uses {
    /// Selectors.
    pub selectors: Vec<Selector>,
    /// Labels of `by`, `without`, `on`, `ignoring`, `group_left`, `group_right`.
    pub grouping: BTreeSet<String>,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Skips a quoted string starting at `i` (a `"`, `'` or `` ` ``); returns the index after it.
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() {
        if chars[j] == '\\' && quote != '`' {
            j += 2;
            continue;
        }
        if chars[j] == quote {
            return j + 1;
        }
        j += 1;
    }
    j
}

fn skip_space(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    i
}

/// Label names of a `{...}` or `(...)` list starting at `open`; the index after it.
fn label_list(chars: &[char], open: usize) -> (Vec<String>, usize) {
    let close = if chars[open] == '{' { '}' } else { ')' };
    let mut names = Vec::new();
    let mut i = open + 1;
    let mut expect_name = true;
    while i < chars.len() && chars[i] != close {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(chars, i);
            continue;
        }
        if c == ',' {
            expect_name = true;
        } else if is_ident_start(c) && expect_name {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            names.push(chars[start..i].iter().collect());
            expect_name = false;
            continue;
        }
        i += 1;
    }
    (names, i + 1)
}

/// The `egress_` selectors and grouping labels of a PromQL expression.
pub fn uses(expr: &str) -> Uses {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Uses::default();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
            continue;
        }
        if c == '{' {
            // A selector without a name (`{__name__=...}`): none of ours.
            let (_, next) = label_list(&chars, i);
            i = next;
            continue;
        }
        if !is_ident_start(c) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && is_ident(chars[i]) {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let after = skip_space(&chars, i);
        let grouping = matches!(
            word.as_str(),
            "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
        );
        if grouping && chars.get(after) == Some(&'(') {
            let (names, next) = label_list(&chars, after);
            out.grouping.extend(names);
            i = next;
        } else if word.starts_with("egress_") {
            let mut labels = Vec::new();
            if chars.get(after) == Some(&'{') {
                let (names, next) = label_list(&chars, after);
                labels = names;
                i = next;
            }
            out.selectors.push(Selector { name: word, labels });
        }
    }
    out
}

/// A metric family of an exposition: its type and the label names its samples carry.
#[derive(Debug, Clone, Default)]
pub struct Family {
    /// `counter`, `gauge`, `histogram`, ...
    pub kind: String,
    /// Label names seen on its samples; empty when it has none.
    pub labels: BTreeSet<String>,
    /// Whether any sample was printed (label names are only known then).
    pub sampled: bool,
}

/// Reads a text exposition (`/metrics`) into families by name.
pub fn families(exposition: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                out.entry(name.to_string()).or_default().kind = kind.to_string();
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let chars: Vec<char> = line.chars().collect();
        let end = chars
            .iter()
            .position(|c| !is_ident(*c))
            .unwrap_or(chars.len());
        let sample: String = chars[..end].iter().collect();
        let labels = if chars.get(end) == Some(&'{') {
            label_list(&chars, end).0
        } else {
            Vec::new()
        };
        let family = family_of(&out, &sample).unwrap_or(sample);
        let f = out.entry(family).or_default();
        f.sampled = true;
        f.labels.extend(labels.into_iter().filter(|l| l != "le"));
    }
    out
}

/// The family a series name belongs to: itself, or without the suffix its type adds.
pub fn family_of(families: &BTreeMap<String, Family>, series: &str) -> Option<String> {
    if families.contains_key(series) {
        return Some(series.to_string());
    }
    for suffix in ["_total", "_bucket", "_count", "_sum", "_created"] {
        if let Some(base) = series.strip_suffix(suffix)
            && families.contains_key(base)
        {
            return Some(base.to_string());
        }
    }
    None
}

/// Metric names the operator registers, read from its source (`operator/src`): the string
/// literals `"egress_..."` passed to `register`. The exposition prints a family only once
/// it has a sample (prometheus-client skips empty families, HELP and TYPE included), so a
/// family the test run never fed (a fence cut, a failed verification) is looked up here.
pub fn registered_in_source() -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for (i, _) in text.match_indices("\"egress_") {
                    let rest = &text[i + 1..];
                    let end = rest
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(rest.len());
                    if rest[end..].starts_with('"') {
                        out.insert(rest[..end].to_string());
                    }
                }
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(&config_dir().join("../operator/src"), &mut out);
    out
}

/// What an expression reads that the exposition does not have: unknown metrics, and labels
/// no sample of the metric carries. A family without samples (absent from the exposition
/// but in `registered`) has unknown labels; it is returned in the second list, unchecked.
pub fn missing(
    families: &BTreeMap<String, Family>,
    registered: &BTreeSet<String>,
    what: &str,
    expr: &str,
) -> (Vec<String>, Vec<String>) {
    let u = uses(expr);
    let mut problems = Vec::new();
    let mut unchecked = Vec::new();
    let mut all_labels: BTreeSet<String> = SCRAPE_LABELS.iter().map(|s| s.to_string()).collect();
    let mut any_unsampled = false;
    for s in &u.selectors {
        let Some(family) = family_of(families, &s.name) else {
            let base = ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .find_map(|suffix| s.name.strip_suffix(suffix))
                .unwrap_or(&s.name);
            if registered.contains(&s.name) || registered.contains(base) {
                any_unsampled = true;
                unchecked.push(format!("{what}: {base} (no sample yet)"));
            } else {
                problems.push(format!("{what}: metric {} is not exported", s.name));
            }
            continue;
        };
        let f = &families[&family];
        if !f.sampled {
            any_unsampled = true;
            unchecked.push(format!("{what}: {family}"));
            continue;
        }
        all_labels.extend(f.labels.iter().cloned());
        for l in &s.labels {
            let known = f.labels.contains(l)
                || SCRAPE_LABELS.contains(&l.as_str())
                || (l == "le" && s.name.ends_with("_bucket"));
            if !known {
                problems.push(format!(
                    "{what}: {} has no label {l} (it has {:?})",
                    s.name, f.labels
                ));
            }
        }
    }
    if !any_unsampled {
        for l in &u.grouping {
            if l != "le" && !all_labels.contains(l) {
                problems.push(format!(
                    "{what}: groups by {l}, which none of its metrics carries"
                ));
            }
        }
    }
    (problems, unchecked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_selectors_and_grouping() {
        let u = uses(
            r#"sum by (namespace, pool) (rate(egress_x_total{state="a,b}",pool!~"x"}[5m]))
               > on () group_left () max(egress_y)"#,
        );
        assert_eq!(
            u.selectors,
            vec![
                Selector {
                    name: "egress_x_total".into(),
                    labels: vec!["state".into(), "pool".into()],
                },
                Selector {
                    name: "egress_y".into(),
                    labels: vec![],
                },
            ]
        );
        assert_eq!(
            u.grouping,
            BTreeSet::from(["namespace".to_string(), "pool".to_string()])
        );
    }

    #[test]
    fn finds_unknown_metrics_and_labels() {
        let exposition = "# HELP egress_x things.\n# TYPE egress_x counter\n\
             egress_x_total{state=\"a\"} 1\n# TYPE egress_h histogram\n\
             egress_h_bucket{le=\"1\"} 0\n# TYPE egress_empty gauge\n";
        let f = families(exposition);
        let registered = BTreeSet::from(["egress_quiet".to_string()]);
        let check = |expr: &str| missing(&f, &registered, "t", expr);
        assert!(f["egress_x"].labels.contains("state"));
        let (p, u) = check("sum by (state) (egress_x_total{state=\"a\"})");
        assert!(p.is_empty() && u.is_empty(), "{p:?} {u:?}");
        let (p, _) = check("egress_x_total{pool=\"a\"} + egress_nope");
        assert_eq!(p.len(), 2, "{p:?}");
        let (p, _) = check("sum by (pool) (egress_x_total)");
        assert_eq!(p.len(), 1, "{p:?}");
        let (p, _) = check("histogram_quantile(0.5, sum by (le) (egress_h_bucket))");
        assert!(p.is_empty(), "{p:?}");
        let (p, u) = check("egress_empty{x=\"1\"}");
        assert!(p.is_empty());
        assert_eq!(u, vec!["t: egress_empty".to_string()]);
        // Registered but never fed: not printed at all, so looked up in the source.
        let (p, u) = check("sum by (pool) (increase(egress_quiet_total[5m]))");
        assert!(p.is_empty(), "{p:?}");
        assert_eq!(u, vec!["t: egress_quiet (no sample yet)".to_string()]);
    }
}
