//! Building cloud-init `#cloud-config` documents without formatting YAML by hand.
//!
//! The document is held as JSON values and serialised with a YAML library, so every
//! string is quoted as YAML needs, whatever it contains. Keys come out sorted, which keeps
//! renders byte-for-byte deterministic.

use serde::Serialize;
use serde_json::{Map, Value, json};

/// A `#cloud-config` document under construction.
///
/// ```
/// use templates_sdk::cloud_config::CloudConfig;
///
/// let doc = CloudConfig::new()
///     .package("tinyproxy")
///     .write_file("/etc/motd", "egress proxy\n", "0644")
///     .run_command(["systemctl", "restart", "tinyproxy"])
///     .render()
///     .unwrap();
/// assert!(doc.starts_with("#cloud-config\n"));
/// assert!(doc.contains("- tinyproxy"));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CloudConfig {
    packages: Vec<Value>,
    write_files: Vec<Value>,
    runcmd: Vec<Value>,
    other: Map<String, Value>,
}

/// The first line cloud-init looks for.
pub const HEADER: &str = "#cloud-config\n";

impl CloudConfig {
    /// An empty document.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a package to `packages`.
    pub fn package(mut self, name: impl Into<String>) -> Self {
        self.packages.push(Value::String(name.into()));
        self
    }

    /// Adds an entry to `write_files`, owned by root.
    pub fn write_file(
        mut self,
        path: impl Into<String>,
        content: impl Into<String>,
        permissions: impl Into<String>,
    ) -> Self {
        self.write_files.push(json!({
            "path": path.into(),
            "content": content.into(),
            "permissions": permissions.into(),
            "owner": "root:root",
        }));
        self
    }

    /// Adds a command to `runcmd`, as an argument vector (no shell parsing).
    pub fn run_command<I, S>(mut self, argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let argv: Vec<Value> = argv.into_iter().map(|a| Value::String(a.into())).collect();
        self.runcmd.push(Value::Array(argv));
        self
    }

    /// Sets another top-level key to any serialisable value (e.g. `ntp`,
    /// `package_update`). `packages`, `write_files` and `runcmd` have their own methods
    /// and are refused here, so entries are never silently replaced.
    pub fn set(mut self, key: impl Into<String>, value: impl Serialize) -> Result<Self, String> {
        let key = key.into();
        if matches!(key.as_str(), "packages" | "write_files" | "runcmd") {
            return Err(format!("use the dedicated method for `{key}`"));
        }
        let value = serde_json::to_value(value).map_err(|e| e.to_string())?;
        self.other.insert(key, value);
        Ok(self)
    }

    /// Serialises to `#cloud-config` YAML.
    pub fn render(&self) -> Result<String, String> {
        let mut doc = self.other.clone();
        for (key, list) in [
            ("packages", &self.packages),
            ("write_files", &self.write_files),
            ("runcmd", &self.runcmd),
        ] {
            if !list.is_empty() {
                doc.insert(key.to_string(), Value::Array(list.clone()));
            }
        }
        let yaml = serde_yaml_ng::to_string(&doc).map_err(|e| e.to_string())?;
        Ok(format!("{HEADER}{yaml}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_strings_stay_strings() {
        let doc = CloudConfig::new()
            .write_file("/etc/x", "a: b\n- c\n#not a comment\n'\"", "0600")
            .package("pkg\nruncmd: [rm, -rf, /]")
            .render()
            .unwrap();
        let parsed: Value = serde_yaml_ng::from_str(&doc).unwrap();
        assert_eq!(parsed["packages"][0], "pkg\nruncmd: [rm, -rf, /]");
        assert_eq!(
            parsed["write_files"][0]["content"],
            "a: b\n- c\n#not a comment\n'\""
        );
        assert!(parsed.get("runcmd").is_none());
    }

    #[test]
    fn set_and_commands() {
        let doc = CloudConfig::new()
            .set("package_update", true)
            .unwrap()
            .run_command(["echo", "hi there"])
            .render()
            .unwrap();
        let parsed: Value = serde_yaml_ng::from_str(&doc).unwrap();
        assert_eq!(parsed["package_update"], true);
        assert_eq!(parsed["runcmd"][0], json!(["echo", "hi there"]));
        assert!(CloudConfig::new().set("runcmd", 1).is_err());
    }
}
