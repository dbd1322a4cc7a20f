//! A domain plugin that reads a host file: its component imports `wasi:filesystem`, which
//! the sandbox must refuse at load, naming the import.
#![forbid(unsafe_code)]

use schemars::JsonSchema;
use serde::Deserialize;
use templates_sdk::DomainPlugin;
use templates_sdk::domain::DomainInput;

/// No settings.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Settings {}

/// The plugin.
#[derive(Debug)]
pub struct ReadsFiles;

impl DomainPlugin for ReadsFiles {
    type Settings = Settings;

    fn render(_input: &DomainInput, _s: &Settings) -> Result<String, String> {
        std::fs::read_to_string("/etc/passwd").map_err(|e| e.to_string())
    }
}

templates_sdk::export_domain_plugin!(ReadsFiles);
