//! A plugin's settings JSON Schema, refused at load unless it is small, shallow,
//! self-contained and cheap to evaluate, then compiled once.
//!
//! The schema is plugin output, so it is untrusted: the operator compiles it and evaluates
//! it against every Proxy's settings overrides on the calling thread, where nothing can
//! interrupt `jsonschema`. So the work is bounded *before* compiling, by rules that refuse
//! what could blow up, each named in the refusal:
//!
//! - `schema-size`: at most [`SCHEMA_MAX_BYTES`] of JSON (checked before the text is even
//!   copied out of the plugin, see `bindings::capped`);
//! - `schema-depth`: nesting of at most [`SCHEMA_MAX_DEPTH`] arrays/objects, checked on the
//!   raw text before parsing (`serde_json` alone would recurse up to 128 levels);
//! - `schema-ref`: every `$ref` points inside the schema (`#` or `#/<JSON pointer>`) at
//!   something that exists; no `$dynamicRef`/`$recursiveRef`, no `$id` below the root and
//!   only a well-known `$schema`, so nothing is ever fetched (the validator is built
//!   `offline()` as well, and the crate is built without its HTTP/file resolvers);
//! - `schema-refs`: at most [`SCHEMA_MAX_REFS`] references;
//! - `schema-recursive-ref`: no reference cycle (settings are finite documents);
//! - `schema-expansion`: at most [`SCHEMA_MAX_EXPANDED`] nodes with every `$ref` expanded,
//!   which is what bounds evaluation: references can share one subschema many times over
//!   (`anyOf` of two references to a definition that does the same, 40 levels deep, is a
//!   few KB of text and 2^40 evaluations);
//! - `schema-pattern`: at most [`SCHEMA_MAX_PATTERNS`] `pattern`/`patternProperties`
//!   regexes, each at most [`SCHEMA_MAX_PATTERN_BYTES`], compiling with the linear-time
//!   `regex` engine within a size limit, so no pattern backtracks catastrophically
//!   (look-around and back-references are refused) or takes long to compile;
//! - `schema-time`: compiling, and evaluating the configured settings at load, each fit a
//!   wall-clock budget ([`SCHEMA_COMPILE_BUDGET`], [`SCHEMA_EVALUATION_BUDGET`]).
//!
//! The rules are what bound each later evaluation (a Proxy's overrides, before every
//! render): the work is at most the expanded schema times the values in the settings
//! (which the config caps at 64 KiB), and refused settings are listed issue by issue only
//! while that product is within [`LISTING_WORK_MAX`], since `jsonschema` builds every
//! error eagerly. An evaluation that still runs past its budget is logged. No thread is
//! spawned to time it out: a thread running `jsonschema` cannot be stopped, only
//! abandoned, so a bound that holds by construction is the one that is enforced.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::errors::{SettingsIssue, TemplateErrorKind};

/// Largest schema accepted. A schema generated from a settings type is a few KB; this is
/// far above that and small enough to walk and compile in milliseconds.
pub const SCHEMA_MAX_BYTES: usize = 256 * 1024;
/// Deepest nesting of JSON arrays/objects accepted; generated schemas nest under 10.
pub const SCHEMA_MAX_DEPTH: usize = 32;
/// Most `$ref`s accepted; generated schemas have one per named type.
pub const SCHEMA_MAX_REFS: usize = 256;
/// Most schema nodes (JSON values) with every `$ref` expanded in place (counted
/// conservatively, see `subtree`). Checking settings is at most this times the number of
/// values in the settings (at most about 16,000 in the 64 KiB the config allows), which
/// measured here is at most about a quarter of a second; generated schemas have a few
/// hundred.
///
/// A plain budget on the schema text cannot do this: references let a few KB expand
/// without end.
pub const SCHEMA_MAX_EXPANDED: u64 = 2_000;
/// Longest `pattern` (or `patternProperties` key) accepted.
pub const SCHEMA_MAX_PATTERN_BYTES: usize = 1024;
/// Most patterns accepted. Each compiles in at most a few milliseconds within the size
/// limits below (measured here), once per schema (one pattern cache per compile); a
/// generated schema has one per field with a `regex` attribute.
pub const SCHEMA_MAX_PATTERNS: usize = 64;
/// Compiled size limit of one pattern (the `regex` crate's own limits; its defaults are
/// 10 MiB and 2 MiB): a short pattern like `([a-z]{1000}){1000}` compiles to far more.
const REGEX_SIZE_LIMIT: usize = 1024 * 1024;
const REGEX_DFA_SIZE_LIMIT: usize = 1024 * 1024;
/// Most (expanded schema nodes × settings values) for which refused settings are listed
/// issue by issue. `jsonschema` builds every error eagerly (about a microsecond each here)
/// and a refusal can have one per pair, so beyond this the refusal is one issue that says
/// the settings do not fit, without the list.
pub const LISTING_WORK_MAX: u64 = 1_000_000;
/// Wall-clock budget of compiling the schema at load.
pub const SCHEMA_COMPILE_BUDGET: Duration = Duration::from_secs(1);
/// Wall-clock budget of one evaluation of settings against the schema.
pub const SCHEMA_EVALUATION_BUDGET: Duration = Duration::from_millis(500);
/// Meta-schemas a plugin may name in `$schema`: the ones the validator knows without
/// fetching anything.
const KNOWN_META_SCHEMAS: &[&str] = &[
    "https://json-schema.org/draft/2020-12/schema",
    "https://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft-07/schema",
    "http://json-schema.org/draft-06/schema",
    "http://json-schema.org/draft-04/schema",
];

fn refuse(rule: &'static str, detail: impl Into<String>) -> TemplateErrorKind {
    TemplateErrorKind::SchemaRefused {
        rule,
        detail: detail.into(),
    }
}

fn show(value: &str) -> String {
    crate::validation::show(value)
}

/// A JSON pointer to a child, for messages.
fn child_path(parent: &str, key: &str) -> String {
    format!("{parent}/{}", key.replace('~', "~0").replace('/', "~1"))
}

/// The refusal of a schema whose text is `len` bytes, over [`SCHEMA_MAX_BYTES`].
pub(crate) fn too_large(len: usize) -> TemplateErrorKind {
    refuse(
        "schema-size",
        format!("is {len} bytes; at most {SCHEMA_MAX_BYTES} are read"),
    )
}

/// A compiled settings schema with its expanded size, which bounds the work of checking
/// settings against it.
#[derive(Debug)]
pub struct Compiled {
    validator: jsonschema::Validator,
    expanded: u64,
    /// The schema document, kept to name the keys an object takes when settings carry
    /// an unknown one.
    document: Value,
}

impl Compiled {
    /// Schema nodes with every `$ref` expanded (see [`SCHEMA_MAX_EXPANDED`]).
    pub fn expanded(&self) -> u64 {
        self.expanded
    }
}

/// Checks the schema text against every rule and compiles it.
pub(crate) fn compile(text: &str) -> Result<Compiled, TemplateErrorKind> {
    if text.len() > SCHEMA_MAX_BYTES {
        return Err(too_large(text.len()));
    }
    check_depth(text)?;
    let value: Value =
        serde_json::from_str(text).map_err(|e| TemplateErrorKind::BadSchema(e.to_string()))?;
    let refs = check_tree(&value)?;
    let expanded = check_expansion(&value, &refs)?;
    let options = options();
    check_patterns(&value, &options)?;
    let start = Instant::now();
    let validator = options
        .build(&value)
        .map_err(|e| TemplateErrorKind::BadSchema(cut(e.to_string())))?;
    let took = start.elapsed();
    if took > SCHEMA_COMPILE_BUDGET {
        return Err(refuse(
            "schema-time",
            format!("took {took:?} to compile; the budget is {SCHEMA_COMPILE_BUDGET:?}"),
        ));
    }
    Ok(Compiled {
        validator,
        expanded,
        document: value,
    })
}

/// How the validator is built: nothing is ever fetched, patterns use the linear-time
/// engine with size limits, each compiled once per schema (the cache lives as long as
/// the options).
fn options() -> jsonschema::ValidationOptions<'static> {
    jsonschema::options()
        .offline()
        .with_pattern_options(
            jsonschema::PatternOptions::regex()
                .size_limit(REGEX_SIZE_LIMIT)
                .dfa_size_limit(REGEX_DFA_SIZE_LIMIT),
        )
        .with_pattern_cache(jsonschema::PatternCache::new())
}

/// A validator's message, cut to a length that fits a log line.
fn cut(mut s: String) -> String {
    const MAX: usize = 512;
    if s.len() > MAX {
        let mut end = MAX;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

/// `schema-depth` on the raw text: the nesting of arrays and objects, outside strings.
fn check_depth(text: &str) -> Result<(), TemplateErrorKind> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (at, b) in text.bytes().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > SCHEMA_MAX_DEPTH {
                    return Err(refuse(
                        "schema-depth",
                        format!(
                            "nests arrays/objects more than {SCHEMA_MAX_DEPTH} deep (at byte {at})"
                        ),
                    ));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// One `$ref`: where it is, and the JSON pointer it names (decoded, without `#`).
#[derive(Debug)]
struct Ref {
    at: String,
    target: String,
}

/// `schema-ref`, `schema-refs`, `schema-pattern` (length), `schema-depth`; returns every
/// `$ref`. Every object is treated as a schema, so a `$ref`-like value inside `const` or
/// `enum` is held to the same rules (stricter than needed, never looser).
fn check_tree(root: &Value) -> Result<Vec<Ref>, TemplateErrorKind> {
    if let Some(meta) = root.get("$schema") {
        let known = meta
            .as_str()
            .map(|m| m.strip_suffix('#').unwrap_or(m))
            .is_some_and(|m| KNOWN_META_SCHEMAS.contains(&m));
        if !known {
            return Err(refuse(
                "schema-ref",
                format!(
                    "$schema {meta} is not a meta-schema the operator knows without fetching (one of {})",
                    KNOWN_META_SCHEMAS.join(", ")
                ),
            ));
        }
    }
    let mut refs = Vec::new();
    let mut patterns = 0usize;
    let mut stack: Vec<(&Value, String, usize)> = vec![(root, String::new(), 1)];
    while let Some((value, path, depth)) = stack.pop() {
        if depth > SCHEMA_MAX_DEPTH {
            return Err(refuse(
                "schema-depth",
                format!("nests more than {SCHEMA_MAX_DEPTH} deep at {}", show(&path)),
            ));
        }
        match value {
            Value::Object(map) => {
                for (key, child) in map {
                    let here = child_path(&path, key);
                    match (key.as_str(), child) {
                        ("$ref", Value::String(r)) => {
                            refs.push(Ref {
                                target: local_target(r, &here)?,
                                at: here.clone(),
                            });
                            if refs.len() > SCHEMA_MAX_REFS {
                                return Err(refuse(
                                    "schema-refs",
                                    format!("has more than {SCHEMA_MAX_REFS} $ref"),
                                ));
                            }
                        }
                        ("$dynamicRef" | "$recursiveRef", _) => {
                            return Err(refuse(
                                "schema-ref",
                                format!("{key} at {} is not supported", show(&here)),
                            ));
                        }
                        ("$id", _) if !path.is_empty() => {
                            return Err(refuse(
                                "schema-ref",
                                format!(
                                    "$id at {} changes the base of references; only the root may have one",
                                    show(&here)
                                ),
                            ));
                        }
                        ("pattern", Value::String(p)) => {
                            pattern_length(p, &here)?;
                            patterns += 1;
                        }
                        ("patternProperties", Value::Object(map)) => {
                            for p in map.keys() {
                                pattern_length(p, &child_path(&here, p))?;
                            }
                            patterns += map.len();
                        }
                        _ => {}
                    }
                    if patterns > SCHEMA_MAX_PATTERNS {
                        return Err(refuse(
                            "schema-pattern",
                            format!("has more than {SCHEMA_MAX_PATTERNS} patterns"),
                        ));
                    }
                    stack.push((child, here, depth + 1));
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    stack.push((child, format!("{path}/{i}"), depth + 1));
                }
            }
            _ => {}
        }
    }
    Ok(refs)
}

fn pattern_length(pattern: &str, at: &str) -> Result<(), TemplateErrorKind> {
    if pattern.len() > SCHEMA_MAX_PATTERN_BYTES {
        return Err(refuse(
            "schema-pattern",
            format!(
                "the pattern at {} is {} bytes; at most {SCHEMA_MAX_PATTERN_BYTES} are accepted",
                show(at),
                pattern.len()
            ),
        ));
    }
    Ok(())
}

/// The JSON pointer a `$ref` names, when it is a reference inside this schema.
fn local_target(reference: &str, at: &str) -> Result<String, TemplateErrorKind> {
    let not_local = || {
        refuse(
            "schema-ref",
            format!(
                "$ref {} at {} is not a reference inside this schema (`#` or `#/...`); plugin schemas must be self-contained, nothing is fetched",
                show(reference),
                show(at)
            ),
        )
    };
    let fragment = reference.strip_prefix('#').ok_or_else(not_local)?;
    if !(fragment.is_empty() || fragment.starts_with('/')) {
        return Err(not_local());
    }
    percent_decode(fragment).ok_or_else(not_local)
}

/// Decodes `%XX` escapes of a URI fragment; `None` when one is malformed or not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The number of values in `value`'s subtree and the targets of the `$ref`s in it (with
/// repetition). Every object counts as applied in place, definitions included (which only
/// apply where referenced): an over-count, never an under-count, since a walker cannot
/// tell a `$defs` keyword from a property of that name without knowing the vocabulary.
fn subtree(value: &Value) -> (u64, Vec<String>) {
    let (mut count, mut refs) = (0u64, Vec::new());
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        count += 1;
        match v {
            Value::Object(map) => {
                for (key, child) in map {
                    if let ("$ref", Value::String(r)) = (key.as_str(), child) {
                        // Every `$ref` was checked to be local by `check_tree`.
                        if let Ok(target) = local_target(r, "") {
                            refs.push(target);
                        }
                    }
                    stack.push(child);
                }
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    (count, refs)
}

/// `schema-ref` (targets exist), `schema-recursive-ref` and `schema-expansion`; returns
/// the expanded size.
fn check_expansion(root: &Value, refs: &[Ref]) -> Result<u64, TemplateErrorKind> {
    // Each distinct target (and the root) with its own size and the targets it refers to.
    let mut nodes: BTreeMap<String, (u64, Vec<String>)> = BTreeMap::new();
    nodes.insert(String::new(), subtree(root));
    for r in refs {
        if nodes.contains_key(&r.target) {
            continue;
        }
        let target = root.pointer(&r.target).ok_or_else(|| {
            refuse(
                "schema-ref",
                format!(
                    "$ref at {} points to #{}, which is not in the schema",
                    show(&r.at),
                    r.target
                ),
            )
        })?;
        nodes.insert(r.target.clone(), subtree(target));
    }
    let mut expanded: BTreeMap<&str, u64> = BTreeMap::new();
    let mut visiting: BTreeSet<&str> = BTreeSet::new();
    let total = expand("", &nodes, &mut expanded, &mut visiting)?;
    if total > SCHEMA_MAX_EXPANDED {
        return Err(refuse(
            "schema-expansion",
            format!(
                "has more than {SCHEMA_MAX_EXPANDED} nodes with every $ref expanded; evaluation work grows with that"
            ),
        ));
    }
    Ok(total)
}

/// The size of `target` with every `$ref` expanded, saturating just above the cap (so the
/// numbers stay small), refusing a cycle. Recursion depth is at most the number of
/// distinct targets, which `schema-refs` bounds.
fn expand<'a>(
    target: &'a str,
    nodes: &'a BTreeMap<String, (u64, Vec<String>)>,
    expanded: &mut BTreeMap<&'a str, u64>,
    visiting: &mut BTreeSet<&'a str>,
) -> Result<u64, TemplateErrorKind> {
    if let Some(size) = expanded.get(target) {
        return Ok(*size);
    }
    let Some((own, refs)) = nodes.get(target) else {
        return Ok(0);
    };
    if !visiting.insert(target) {
        return Err(refuse(
            "schema-recursive-ref",
            format!(
                "#{target} refers to itself through $ref; settings schemas must not be recursive"
            ),
        ));
    }
    let mut size = *own;
    for r in refs {
        size = size.saturating_add(expand(r, nodes, expanded, visiting)?);
        if size > SCHEMA_MAX_EXPANDED {
            size = SCHEMA_MAX_EXPANDED + 1;
            break;
        }
    }
    visiting.remove(target);
    expanded.insert(target, size);
    Ok(size)
}

/// `schema-pattern`: every pattern compiles on its own with the options the schema is
/// built with, so a refusal names the pattern instead of the whole schema.
fn check_patterns(
    root: &Value,
    options: &jsonschema::ValidationOptions<'static>,
) -> Result<(), TemplateErrorKind> {
    let mut stack: Vec<(&Value, String)> = vec![(root, String::new())];
    while let Some((value, path)) = stack.pop() {
        match value {
            Value::Object(map) => {
                for (key, child) in map {
                    let here = child_path(&path, key);
                    match (key.as_str(), child) {
                        ("pattern", Value::String(p)) => {
                            compile_pattern(
                                options,
                                serde_json::json!({ "pattern": p }),
                                p,
                                &here,
                            )?;
                        }
                        ("patternProperties", Value::Object(patterns)) => {
                            for p in patterns.keys() {
                                let probe =
                                    serde_json::json!({ "patternProperties": { p.clone(): true } });
                                compile_pattern(options, probe, p, &child_path(&here, p))?;
                            }
                        }
                        _ => {}
                    }
                    stack.push((child, here));
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    stack.push((child, format!("{path}/{i}")));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn compile_pattern(
    options: &jsonschema::ValidationOptions<'static>,
    probe: Value,
    pattern: &str,
    at: &str,
) -> Result<(), TemplateErrorKind> {
    options.build(&probe).map(|_| ()).map_err(|e| {
        refuse(
            "schema-pattern",
            format!(
                "the pattern {} at {} does not compile with the linear-time regex engine (no look-around or back-references; at most {REGEX_SIZE_LIMIT} bytes compiled): {}",
                show(pattern),
                show(at),
                cut(e.to_string())
            ),
        )
    })
}

/// Every place `settings` breaks `schema`, at most `keep` of them with their messages, and
/// how many there are in all; logs an evaluation that ran past its budget. Valid settings
/// cost one short-circuiting pass; refused ones are listed only within
/// [`LISTING_WORK_MAX`].
pub(crate) fn evaluate(
    schema: &Compiled,
    settings: &Value,
    keep: usize,
) -> (Vec<SettingsIssue>, usize, Duration) {
    let start = Instant::now();
    let (kept, total) = if schema.validator.is_valid(settings) {
        (Vec::new(), 0)
    } else {
        let values = subtree(settings).0;
        let work = schema.expanded.saturating_mul(values);
        if work > LISTING_WORK_MAX {
            let issue = SettingsIssue {
                pointer: String::new(),
                message: format!(
                    "do not fit the plugin's settings schema (where is not listed: {values} values against a schema of {} expanded nodes is more work than {LISTING_WORK_MAX})",
                    schema.expanded
                ),
            };
            (vec![issue], 1)
        } else {
            let mut kept = Vec::new();
            let mut total = 0;
            for e in schema.validator.iter_errors(settings) {
                let issues = issues_of(&schema.document, &e);
                total += issues.len();
                let room = keep.saturating_sub(kept.len());
                kept.extend(issues.into_iter().take(room));
            }
            (kept, total)
        }
    };
    let took = start.elapsed();
    if took > SCHEMA_EVALUATION_BUDGET {
        tracing::warn!(
            took = ?took,
            budget = ?SCHEMA_EVALUATION_BUDGET,
            "evaluating settings against a plugin's schema ran past its budget"
        );
    }
    (kept, total, took)
}

/// The issues one validation error stands for. An object with keys its schema does not
/// take (`additionalProperties: false`, what `deny_unknown_fields` generates) is one error
/// at the object; it becomes one issue per key, at the key, with the nearest key the
/// object does take when one is close (a typo), so `validate-config` and a Proxy's
/// refused override point at what to fix.
fn issues_of(document: &Value, e: &jsonschema::ValidationError<'_>) -> Vec<SettingsIssue> {
    let at = e.instance_path().to_string();
    match e.kind() {
        jsonschema::error::ValidationErrorKind::AdditionalProperties { unexpected } => {
            let known = known_keys(document, &e.schema_path().to_string());
            unexpected
                .iter()
                .map(|key| {
                    let mut message = format!("unknown key {}", show(key));
                    if let Some(near) = nearest(key, &known) {
                        message.push_str(&format!("; did you mean `{near}`?"));
                    }
                    SettingsIssue {
                        pointer: child_path(&at, key),
                        message,
                    }
                })
                .collect()
        }
        jsonschema::error::ValidationErrorKind::OneOfNotValid { .. }
        | jsonschema::error::ValidationErrorKind::AnyOf { .. }
        | jsonschema::error::ValidationErrorKind::Enum { .. }
        | jsonschema::error::ValidationErrorKind::Constant { .. } => {
            // The keyword's schema object, whose alternatives may all be fixed values (an
            // enum as schemars writes it: `oneOf` of `const`s, maybe behind a `$ref` and
            // an `anyOf` with null for an `Option`).
            let keyword = e.schema_path().to_string();
            let holder = keyword.rsplit_once('/').map_or("", |(p, _)| p);
            let allowed = document
                .pointer(holder)
                .and_then(|node| allowed_values(document, node, 0));
            let message = match allowed {
                Some(values) => format!(
                    "{} is not allowed; expected {}",
                    e.instance(),
                    one_of(&values)
                ),
                None => e.to_string(),
            };
            vec![SettingsIssue {
                pointer: at,
                message,
            }]
        }
        _ => vec![SettingsIssue {
            pointer: at,
            message: e.to_string(),
        }],
    }
}

/// Most alternatives followed when listing what a value may be: an enum of a plugin's
/// settings is short, and a refusal names at most this many.
const ALLOWED_MAX: usize = 32;

/// `node`, or what its local `$ref` points at (one step).
pub(crate) fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    node.get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix('#'))
        .and_then(|p| root.pointer(p))
        .unwrap_or(node)
}

/// The values `node` allows when they are a finite list (`const`, `enum`, `null`, and
/// `oneOf`/`anyOf` of those, through local `$ref`s), in schema order; `None` when the
/// node allows more than a list can say.
pub(crate) fn allowed_values(root: &Value, node: &Value, depth: usize) -> Option<Vec<Value>> {
    if depth > 4 {
        return None;
    }
    let node = resolve(root, node);
    if let Some(v) = node.get("const") {
        return Some(vec![v.clone()]);
    }
    if let Some(values) = node.get("enum").and_then(Value::as_array) {
        return Some(values.iter().take(ALLOWED_MAX).cloned().collect());
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(options) = node.get(key).and_then(Value::as_array) {
            let mut out: Vec<Value> = Vec::new();
            for o in options {
                for v in allowed_values(root, o, depth + 1)? {
                    if !out.contains(&v) && out.len() < ALLOWED_MAX {
                        out.push(v);
                    }
                }
            }
            return Some(out);
        }
    }
    (node.get("type").and_then(Value::as_str) == Some("null")).then(|| vec![Value::Null])
}

/// `one of "a", "b"` (or the single value), as JSON.
fn one_of(values: &[Value]) -> String {
    let shown: Vec<String> = values.iter().map(ToString::to_string).collect();
    match shown.as_slice() {
        [one] => one.clone(),
        _ => format!("one of {}", shown.join(", ")),
    }
}

/// The keys declared by the schema object that holds the keyword at `keyword` (a JSON
/// pointer into the document, ending at `additionalProperties`); none when it cannot be
/// resolved.
fn known_keys(document: &Value, keyword: &str) -> Vec<String> {
    let parent = keyword.rsplit_once('/').map_or("", |(p, _)| p);
    document
        .pointer(parent)
        .and_then(|o| o.get("properties"))
        .and_then(Value::as_object)
        .map(|props| props.keys().cloned().collect())
        .unwrap_or_default()
}

/// The known key nearest to `key` when it is near enough to be a likely typo (the same
/// rule as the SDK's `settings::parse`).
fn nearest<'k>(key: &str, known: &'k [String]) -> Option<&'k str> {
    // A typo is short; a long key is compared with nothing (the work is length squared).
    if key.len() > 64 {
        return None;
    }
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.as_str())
}

/// The refusal of a schema whose evaluation at load took `took`, over the budget.
pub(crate) fn too_slow(took: Duration) -> TemplateErrorKind {
    refuse(
        "schema-time",
        format!(
            "took {took:?} to evaluate the configured settings; the budget is {SCHEMA_EVALUATION_BUDGET:?}"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rule_of(schema: &str) -> Option<&'static str> {
        match compile(schema) {
            Ok(_) => None,
            Err(TemplateErrorKind::SchemaRefused { rule, .. }) => Some(rule),
            Err(TemplateErrorKind::BadSchema(_)) => Some("bad-schema"),
            Err(other) => panic!("unexpected refusal: {other}"),
        }
    }

    /// A schema like the SDK generates (schemars, draft 2020-12).
    fn generated() -> Value {
        json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "Settings",
            "type": "object",
            "properties": {
                "machine": {"type": "string", "pattern": "^(q35|pc)$"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "mode": {"$ref": "#/$defs/Mode"},
                "names": {"type": "array", "items": {"$ref": "#/$defs/Name"}}
            },
            "additionalProperties": false,
            "$defs": {
                "Mode": {"oneOf": [{"const": "a"}, {"const": "b"}]},
                "Name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,62}$"}
            }
        })
    }

    #[test]
    fn ordinary_schemas_compile() {
        assert_eq!(rule_of(&generated().to_string()), None);
        assert_eq!(rule_of("{}"), None);
        assert_eq!(rule_of("true"), None);
        // A percent-encoded pointer and a root reference from inside a definition are fine
        // when they do not recurse.
        let s = json!({"$defs": {"a b": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a%20b"}}});
        assert_eq!(rule_of(&s.to_string()), None);
    }

    #[test]
    fn hostile_schemas_are_refused_naming_the_rule() {
        let deep = |n: usize| {
            let mut s = json!({"type": "string"});
            for _ in 0..n {
                s = json!({"properties": {"a": s}});
            }
            s.to_string()
        };
        let chain = |n: usize| {
            let mut defs = serde_json::Map::new();
            for i in 0..n {
                defs.insert(
                    format!("d{i}"),
                    json!({"anyOf": [{"$ref": format!("#/$defs/d{}", i + 1)}, {"$ref": format!("#/$defs/d{}", i + 1)}]}),
                );
            }
            defs.insert(format!("d{n}"), json!({"type": "string"}));
            json!({"$defs": defs, "$ref": "#/$defs/d0"}).to_string()
        };
        let cases: Vec<(&str, String, &str)> = vec![
            ("over the size cap", format!("{{\"description\": \"{}\"}}", "x".repeat(SCHEMA_MAX_BYTES)), "schema-size"),
            ("nested 33 objects deep (15 schema levels)", deep(16), "schema-depth"),
            ("nested past serde_json's own limit", "[".repeat(200) + &"]".repeat(200), "schema-depth"),
            ("remote $ref", json!({"$ref": "https://schemas.example.org/s.json"}).to_string(), "schema-ref"),
            ("relative $ref", json!({"properties": {"a": {"$ref": "other.json#/x"}}}).to_string(), "schema-ref"),
            ("anchor $ref", json!({"$ref": "#anchor"}).to_string(), "schema-ref"),
            ("$ref to nothing", json!({"$ref": "#/$defs/missing"}).to_string(), "schema-ref"),
            ("$dynamicRef", json!({"$dynamicRef": "#meta"}).to_string(), "schema-ref"),
            ("nested $id", json!({"properties": {"a": {"$id": "https://elsewhere.example/"}}}).to_string(), "schema-ref"),
            ("unknown $schema", json!({"$schema": "https://evil.example/meta"}).to_string(), "schema-ref"),
            ("self reference", json!({"anyOf": [{"$ref": "#"}]}).to_string(), "schema-recursive-ref"),
            ("reference cycle", json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"}).to_string(), "schema-recursive-ref"),
            ("doubling reference chain", chain(40), "schema-expansion"),
            ("too many references", json!({"allOf": vec![json!({"$ref": "#/$defs/a"}); SCHEMA_MAX_REFS + 1], "$defs": {"a": {}}}).to_string(), "schema-refs"),
            ("long pattern", json!({"pattern": "a".repeat(SCHEMA_MAX_PATTERN_BYTES + 1)}).to_string(), "schema-pattern"),
            ("long patternProperties key", json!({"patternProperties": {"b".repeat(SCHEMA_MAX_PATTERN_BYTES + 1): true}}).to_string(), "schema-pattern"),
            ("too many patterns", json!({"properties": (0..=SCHEMA_MAX_PATTERNS).map(|i| (format!("p{i}"), json!({"pattern": format!("^{i}$")}))).collect::<serde_json::Map<_, _>>()}).to_string(), "schema-pattern"),
            ("pattern compiling past the size limit", json!({"pattern": "([a-z]{1000}){1000}"}).to_string(), "schema-pattern"),
            ("back-reference", json!({"properties": {"x": {"pattern": "^(a+)\\1$"}}}).to_string(), "schema-pattern"),
            ("look-ahead", json!({"patternProperties": {"^(?=a)(a+)+$": true}}).to_string(), "schema-pattern"),
            ("not JSON", "{".into(), "bad-schema"),
        ];
        for (name, schema, rule) in cases {
            assert_eq!(rule_of(&schema), Some(rule), "{name}");
        }
    }

    #[test]
    fn depth_and_expansion_limits_sit_where_documented() {
        // SCHEMA_MAX_DEPTH levels of arrays pass, one more is refused.
        let at = |n: usize| "[".repeat(n) + &"]".repeat(n);
        assert!(check_depth(&at(SCHEMA_MAX_DEPTH)).is_ok());
        assert!(check_depth(&at(SCHEMA_MAX_DEPTH + 1)).is_err());
        // Brackets inside strings do not count.
        assert!(check_depth(&format!("[\"{}\\\"\"]", "[".repeat(100))).is_ok());
        // A chain that doubles 6 times expands to about 7 * 2^6 nodes, counted about three
        // times over (definitions count where they are written too): accepted; 8 times is
        // over the cap however it is counted.
        let chain = |n: usize| {
            let mut defs = serde_json::Map::new();
            for i in 0..n {
                defs.insert(
                    format!("d{i}"),
                    json!({"anyOf": [{"$ref": format!("#/$defs/d{}", i + 1)}, {"$ref": format!("#/$defs/d{}", i + 1)}]}),
                );
            }
            defs.insert(format!("d{n}"), json!({}));
            json!({"$defs": defs, "$ref": "#/$defs/d0"})
        };
        assert_eq!(rule_of(&chain(6).to_string()), None);
        assert_eq!(rule_of(&chain(8).to_string()), Some("schema-expansion"));
    }

    #[test]
    fn evaluation_keeps_a_few_issues_and_counts_all() {
        let schema = compile(&json!({"items": {"type": "string"}}).to_string()).unwrap();
        let settings = Value::Array(vec![json!(1); 1000]);
        let (kept, total, _) = evaluate(&schema, &settings, 5);
        assert_eq!((kept.len(), total), (5, 1000));
        assert_eq!(kept[0].pointer, "/0");
        let (kept, total, _) = evaluate(&schema, &json!(["a", "b"]), 5);
        assert_eq!((kept.len(), total), (0, 0));
    }

    /// An unknown key is an issue at the key, not at the object holding it, with the
    /// nearest key that object takes (here inside a `$defs` type, as schemars writes a
    /// nested settings struct), and none when nothing is near.
    #[test]
    fn an_unknown_key_is_reported_at_the_key_with_the_nearest_known_one() {
        let schema = compile(
            &json!({
                "type": "object",
                "additionalProperties": false,
                "properties": {"listenPort": {"type": "integer"}, "nics": {"type": "array", "items": {"$ref": "#/$defs/Nic"}}},
                "$defs": {"Nic": {"type": "object", "additionalProperties": false, "properties": {"bridge": {"type": "string"}}}}
            })
            .to_string(),
        )
        .unwrap();
        let settings = json!({"listenPrt": 1, "zzz": 2, "nics": [{"brige": "br0"}]});
        let (kept, total, _) = evaluate(&schema, &settings, 10);
        let shown: Vec<String> = kept.iter().map(ToString::to_string).collect();
        assert_eq!(total, 3, "{shown:?}");
        assert!(
            shown.contains(
                &"/listenPrt: unknown key \"listenPrt\"; did you mean `listenPort`?".to_string()
            ),
            "{shown:?}"
        );
        assert!(
            shown.contains(&"/zzz: unknown key \"zzz\"".to_string()),
            "{shown:?}"
        );
        assert!(
            shown.contains(
                &"/nics/0/brige: unknown key \"brige\"; did you mean `bridge`?".to_string()
            ),
            "{shown:?}"
        );
    }

    /// An enum setting refused names what it may be (issue 34): schemars writes a Rust
    /// enum as a `oneOf` of `const`s, and an `Option` of it as an `anyOf` with null behind
    /// a `$ref`; the validator alone says only "is not valid under any of the schemas".
    #[test]
    fn a_refused_enum_value_names_the_allowed_ones() {
        let schema = compile(
            &json!({
                "type": "object",
                "properties": {
                    "diskCache": {"oneOf": [{"const": "none", "type": "string"}, {"const": "writeback", "type": "string"}]},
                    "cpuMode": {"anyOf": [{"$ref": "#/$defs/CpuMode"}, {"type": "null"}]},
                    "bus": {"enum": ["virtio", "sata"]},
                    "port": {"anyOf": [{"type": "integer"}, {"type": "null"}]}
                },
                "$defs": {"CpuMode": {"oneOf": [{"const": "host-passthrough"}, {"const": "host-model"}]}}
            })
            .to_string(),
        )
        .unwrap();
        let settings =
            json!({"diskCache": "unsafe", "cpuMode": "custom", "bus": "ide", "port": "x"});
        let (kept, _, _) = evaluate(&schema, &settings, 10);
        let shown: Vec<String> = kept.iter().map(ToString::to_string).collect();
        for want in [
            "/diskCache: \"unsafe\" is not allowed; expected one of \"none\", \"writeback\"",
            "/cpuMode: \"custom\" is not allowed; expected one of \"host-passthrough\", \"host-model\", null",
            "/bus: \"ide\" is not allowed; expected one of \"virtio\", \"sata\"",
        ] {
            assert!(shown.contains(&want.to_string()), "{want}\n{shown:#?}");
        }
        // Not a list of values: the validator's own words.
        assert!(
            shown
                .iter()
                .any(|s| s.starts_with("/port: ") && !s.contains("expected")),
            "{shown:#?}"
        );
    }

    /// The widest schema the caps allow (every node applied to every array element)
    /// against the largest settings the config allows: checking valid settings stays
    /// within the budget, and refused ones are not listed one by one (which took about
    /// 14 s for this pair before `LISTING_WORK_MAX`).
    #[test]
    fn the_worst_schema_the_caps_allow_is_cheap_to_evaluate() {
        // Each condition is three nodes; the rest of the schema a handful.
        let n = usize::try_from(SCHEMA_MAX_EXPANDED / 3 - 5).unwrap();
        let schema =
            json!({"items": {"allOf": vec![json!({"type": "string", "minLength": 1}); n]}});
        let schema = compile(&schema.to_string()).unwrap();
        let max = crate::config::validate::limits::TEMPLATE_SETTINGS_BYTES;
        // `"a",` is four bytes: as many values as fit the settings cap.
        let count = max / 4;
        let (kept, total, took) = evaluate(&schema, &Value::Array(vec![json!("a"); count]), 16);
        assert_eq!((kept.len(), total), (0, 0));
        assert!(
            took < SCHEMA_EVALUATION_BUDGET,
            "valid settings took {took:?}"
        );
        let (kept, total, took) = evaluate(&schema, &Value::Array(vec![json!(""); count]), 16);
        assert_eq!((kept.len(), total), (1, 1));
        assert!(kept[0].message.contains("is not listed"), "{kept:?}");
        assert!(
            took < SCHEMA_EVALUATION_BUDGET,
            "refused settings took {took:?}"
        );
    }
}
