//! A plugin's settings, documented from the JSON Schema it exports: one table row per
//! setting (nested objects as `a.b`), with its type, default and description.
//!
//! The schema is what the operator checks settings against, so a table generated from
//! it cannot drift from what is accepted; `plugins/README.md` carries one per default
//! plugin and a test keeps them in step.

use serde_json::Value;

use super::schema::resolve;

/// A Markdown table of the settings `schema` (JSON text) describes.
pub fn markdown(schema: &str) -> Result<String, serde_json::Error> {
    let root: Value = serde_json::from_str(schema)?;
    let mut rows = Vec::new();
    let defaults = root.get("default").cloned().unwrap_or(Value::Null);
    collect(&root, &root, "", &defaults, &mut rows, 0);
    let mut out = String::from("| setting | type | default | description |\n|---|---|---|---|\n");
    for r in rows {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            r.key, r.ty, r.default, r.description
        ));
    }
    Ok(out)
}

struct Row {
    key: String,
    ty: String,
    default: String,
    description: String,
}

/// Nesting deeper than this is shown as one row (schemas are bounded at load anyway).
const MAX_NESTING: usize = 4;

fn collect(
    root: &Value,
    node: &Value,
    prefix: &str,
    defaults: &Value,
    rows: &mut Vec<Row>,
    depth: usize,
) {
    let node = resolve(root, node);
    let Some(props) = node.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (key, prop) in props {
        let full = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        let target = resolve(root, prop);
        let default = prop
            .get("default")
            .or_else(|| defaults.get(key))
            .cloned()
            .unwrap_or(Value::Null);
        let description = prop
            .get("description")
            .or_else(|| target.get("description"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace('|', "\\|");
        let nested = target.get("properties").is_some() && depth < MAX_NESTING;
        rows.push(Row {
            key: full.clone(),
            ty: type_of(root, prop),
            default: match &default {
                Value::Null if nested => "see below".into(),
                Value::Null => "none".into(),
                v => format!("`{v}`"),
            },
            description,
        });
        if nested {
            collect(root, target, &full, &default, rows, depth + 1);
        }
    }
}

/// A short type: `string`, `integer (≤ 3)`, `"q35" \| "pc"`, `list of string`, ...
fn type_of(root: &Value, node: &Value) -> String {
    let node = resolve(root, node);
    if let Some(values) = node.get("enum").and_then(Value::as_array) {
        return values
            .iter()
            .map(|v| format!("`{v}`"))
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    if let Some(v) = node.get("const") {
        return format!("`{v}`");
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = node.get(key).and_then(Value::as_array) {
            let shown: Vec<String> = options
                .iter()
                .filter(|o| o.get("type").and_then(Value::as_str) != Some("null"))
                .map(|o| type_of(root, o))
                .collect();
            let optional = shown.len() < options.len();
            let joined = shown.join(" or ");
            return if optional {
                format!("{joined} (optional)")
            } else {
                joined
            };
        }
    }
    let base = match node.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => {
            let non_null: Vec<&str> = ts
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect();
            let joined = non_null.join(" or ");
            if non_null.len() < ts.len() {
                format!("{joined} (optional)")
            } else {
                joined
            }
        }
        _ => "any".into(),
    };
    let base = if base.starts_with("array") {
        match node.get("items") {
            Some(items) => format!("list of {}", type_of(root, items)),
            None => base,
        }
    } else {
        base
    };
    let mut bounds = Vec::new();
    if let Some(m) = node.get("minimum") {
        bounds.push(format!("≥ {m}"));
    }
    if let Some(m) = node.get("maximum") {
        bounds.push(format!("≤ {m}"));
    }
    if let Some(p) = node.get("pattern").and_then(Value::as_str) {
        bounds.push(format!("matching `{}`", p.replace('|', "\\|")));
    }
    if let Some(m) = node.get("maxItems") {
        bounds.push(format!("at most {m}"));
    }
    if bounds.is_empty() {
        base
    } else {
        format!("{base} ({})", bounds.join(", "))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_types_defaults_and_bounds_are_shown() {
        let schema = json!({
            "type": "object",
            "default": {"machine": "q35", "uefi": {"loader": "/a"}},
            "properties": {
                "machine": {"type": "string", "pattern": "^(q35|pc)$", "description": "QEMU\n machine type."},
                "extraNics": {"type": "integer", "minimum": 0, "maximum": 3, "default": 0},
                "cpuMode": {"anyOf": [{"$ref": "#/$defs/CpuMode"}, {"type": "null"}]},
                "ports": {"type": "array", "items": {"type": "integer"}},
                "uefi": {"$ref": "#/$defs/Uefi"}
            },
            "$defs": {
                "CpuMode": {"type": "string", "enum": ["host-model", "host-passthrough"]},
                "Uefi": {"type": "object", "description": "UEFI files.", "properties": {"loader": {"type": "string"}}}
            }
        });
        let table = markdown(&schema.to_string()).unwrap();
        for want in [
            "| `machine` | string (matching `^(q35\\|pc)$`) | `\"q35\"` | QEMU machine type. |",
            "| `extraNics` | integer (≥ 0, ≤ 3) | `0` |  |",
            "| `cpuMode` | `\"host-model\"` \\| `\"host-passthrough\"` (optional) | none |  |",
            "| `ports` | list of integer | none |  |",
            "| `uefi` | object | `{\"loader\":\"/a\"}` | UEFI files. |",
            "| `uefi.loader` | string | `\"/a\"` |  |",
        ] {
            assert!(table.contains(want), "missing {want}\n{table}");
        }
    }
}
