//! Plugin settings: their JSON Schema, parsing with JSON-pointer errors, validation.
//!
//! A plugin's settings type derives `serde::Deserialize` and `schemars::JsonSchema`; the
//! schema the plugin exports and the parser it uses then come from the same type, so they
//! cannot drift apart.

use schemars::JsonSchema;
use serde::de::DeserializeOwned;

/// One problem with a settings document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingsProblem {
    /// JSON pointer (RFC 6901) to the offending value; empty for the whole document.
    pub pointer: String,
    /// Why the value is refused.
    pub message: String,
}

impl SettingsProblem {
    /// A problem at `pointer` (e.g. `/listenPort`).
    pub fn new(pointer: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            pointer: pointer.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for SettingsProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.pointer.is_empty() {
            "/"
        } else {
            &self.pointer
        };
        write!(f, "{at}: {}", self.message)
    }
}

/// The JSON Schema of `S`, as JSON text.
///
/// ```
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct S { port: u16 }
/// let schema = templates_sdk::settings::schema_json::<S>();
/// assert!(schema.contains("\"port\""));
/// ```
pub fn schema_json<S: JsonSchema>() -> String {
    let schema = schemars::schema_for!(S);
    serde_json::to_string(&schema).unwrap_or_else(|_| "{}".to_string())
}

/// Parses settings JSON into `S`, reporting where it failed as a JSON pointer.
///
/// ```
/// #[derive(Debug, serde::Deserialize)]
/// struct S { ports: Vec<u16> }
/// let err = templates_sdk::settings::parse::<S>(r#"{"ports": [80, "x"]}"#).unwrap_err();
/// assert_eq!(err.pointer, "/ports/1");
/// ```
///
/// An unknown key is reported at the key itself, with the closest known key when one is
/// near:
///
/// ```
/// #[derive(Debug, serde::Deserialize)]
/// #[serde(deny_unknown_fields, rename_all = "camelCase")]
/// struct S { listen_port: u16 }
/// let err = templates_sdk::settings::parse::<S>(r#"{"listenPrt": 1}"#).unwrap_err();
/// assert_eq!(err.pointer, "/listenPrt");
/// assert!(err.message.contains("did you mean `listenPort`?"), "{err}");
/// ```
pub fn parse<S: DeserializeOwned>(json: &str) -> Result<S, SettingsProblem> {
    let mut de = serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let mut pointer = pointer_of(e.path());
        let mut message = e.into_inner().to_string();
        if let Some((key, expected)) = unknown_field(&message) {
            // The path usually ends at the key already; where it does not (a flattened
            // struct, an enum), the key is added, so the pointer never stops at `/`.
            let escaped = format!("/{}", key.replace('~', "~0").replace('/', "~1"));
            if !pointer.ends_with(&escaped) {
                pointer.push_str(&escaped);
            }
            if let Some(near) = closest(&key, &expected) {
                message.push_str(&format!("; did you mean `{near}`?"));
            }
        }
        SettingsProblem { pointer, message }
    })
}

/// The key and the expected keys of serde's "unknown field `k`, expected one of `a`,
/// `b`" (or "expected `a`", or "there are no fields").
fn unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    Some((key.to_string(), expected))
}

/// The known key nearest to `key`, if it is near enough to be a likely typo.
fn closest(key: &str, known: &[String]) -> Option<String> {
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.clone())
}

/// Parses settings and runs the plugin's own checks on them, collecting every problem.
pub fn validate_with<S: DeserializeOwned>(
    json: &str,
    check: impl FnOnce(&S) -> Vec<SettingsProblem>,
) -> Result<(), Vec<SettingsProblem>> {
    let settings = parse::<S>(json).map_err(|p| vec![p])?;
    let problems = check(&settings);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

fn pointer_of(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => {
                out.push('/');
                out.push_str(&index.to_string());
            }
            Segment::Map { key } | Segment::Enum { variant: key } => {
                out.push('/');
                out.push_str(&key.replace('~', "~0").replace('/', "~1"));
            }
            Segment::Unknown => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct S {
        #[serde(rename = "a/b")]
        ab: Option<u8>,
        list: Option<Vec<u8>>,
    }

    #[test]
    fn pointers_escape_per_rfc6901() {
        assert_eq!(parse::<S>(r#"{"a/b": 300}"#).unwrap_err().pointer, "/a~1b");
        assert_eq!(
            parse::<S>(r#"{"list": [1, -1]}"#).unwrap_err().pointer,
            "/list/1"
        );
        let unknown = parse::<S>(r#"{"zzz": 1}"#).unwrap_err();
        assert!(unknown.message.contains("unknown field"), "{unknown}");
        assert_eq!(unknown.pointer, "/zzz");
        assert!(!unknown.message.contains("did you mean"), "{unknown}");
        let typo = parse::<S>(r#"{"lst": [1]}"#).unwrap_err();
        assert_eq!(typo.pointer, "/lst");
        assert!(typo.message.ends_with("did you mean `list`?"), "{typo}");
    }

    #[test]
    fn validate_collects_plugin_problems() {
        let r = validate_with::<S>("{}", |_| {
            vec![
                SettingsProblem::new("/a", "x"),
                SettingsProblem::new("", "y"),
            ]
        });
        let problems = r.unwrap_err();
        assert_eq!(problems.len(), 2);
        assert_eq!(problems[1].to_string(), "/: y");
        assert!(validate_with::<S>("{}", |_| vec![]).is_ok());
    }
}
