//! Checks on plugin output, before anything reaches libvirt or cloud-init.
//!
//! A plugin is code a site wrote; its output is untrusted input. Domain XML is checked in
//! three steps, each reading the document exactly as libvirt will or refusing it:
//!
//! 1. `tree`: a strict parse into a tree with libxml2's reading of attributes, text,
//!    entities, namespaces and characters (no namespaces outside `<metadata>`, no CDATA,
//!    no mixed text, no DOCTYPE, UTF-8 only, ...), bounded in size and depth;
//! 2. `allow`: every element path, attribute and value on an allow-list of what a proxy
//!    VM needs; anything else is refused, naming its path and the rule;
//! 3. `domain`: the document tied to its input: name, UUID, the operator's mark (one
//!    element, structurally equal), memory, vCPUs, the prepared volumes and their formats,
//!    the seed read-only, the bridge, the assigned MAC, known firmware files.
//!
//! The same checks run again on libvirt's own reading of the defined domain
//! ([`check_defined_domain_xml`]) before it is started, so a document that libvirt
//! understands differently from us is caught there too.

mod allow;
mod domain;
mod tree;

pub use allow::{Reading, render_markdown as allow_list_markdown};
pub use domain::{FIRMWARE_CODE, FIRMWARE_VARS, NVRAM_DIR};
pub use tree::{MAX_DEPTH, MAX_ELEMENTS};

use super::DomainInput;
use super::errors::TemplateErrorKind;

/// Largest domain XML accepted; real ones are a few KB.
pub const DOMAIN_XML_MAX: usize = 256 * 1024;
/// Largest vendor-data accepted; it goes into a seed ISO next to user-data.
pub const VENDOR_DATA_MAX: usize = 512 * 1024;

fn refuse(rule: &'static str, detail: impl Into<String>) -> TemplateErrorKind {
    TemplateErrorKind::InvalidOutput {
        rule,
        detail: detail.into(),
    }
}

/// A value quoted for an error message: escaped and shortened.
fn show(value: &str) -> String {
    crate::validation::show(value)
}

/// Checks rendered domain XML against the input it was rendered from.
pub fn check_domain_xml(xml: &str, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    check_reading(xml, input, Reading::Plugin)
}

/// Checks libvirt's own reading of a defined domain (its inactive XML,
/// `virDomainGetXMLDesc(VIR_DOMAIN_XML_INACTIVE)`) against the input the plugin rendered
/// from, before the domain is ever started. libvirt fills in defaults (emulator, addresses,
/// controllers, generated MACs of further NICs, the NVRAM path); everything else obeys the
/// same rules as the plugin's output, so a document libvirt reads differently is caught.
pub fn check_defined_domain_xml(xml: &str, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    check_reading(xml, input, Reading::Libvirt)
}

fn check_reading(
    xml: &str,
    input: &DomainInput,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    if xml.len() > DOMAIN_XML_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: xml.len(),
            max: DOMAIN_XML_MAX,
        });
    }
    let doc = tree::parse(xml, tree::Opaque::DomainMetadata)?;
    domain::check(&doc, input, reading)
}

/// Checks rendered vendor-data: `#cloud-config` YAML that parses to a mapping, or a MIME
/// multipart document with its boundary.
pub fn check_vendor_data(text: &str) -> Result<(), TemplateErrorKind> {
    if text.len() > VENDOR_DATA_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: text.len(),
            max: VENDOR_DATA_MAX,
        });
    }
    let first = text.lines().next().unwrap_or_default().trim_end();
    if first == "#cloud-config" {
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
            .map_err(|e| refuse("cloud-config-yaml", format!("does not parse as YAML: {e}")))?;
        return match doc {
            serde_yaml_ng::Value::Mapping(_) => Ok(()),
            serde_yaml_ng::Value::Null => Ok(()),
            _ => Err(refuse("cloud-config-yaml", "top level must be a mapping")),
        };
    }
    let lower_headers: String = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n")
        .to_ascii_lowercase();
    if lower_headers.contains("content-type: multipart/") {
        let boundary = lower_headers
            .split("boundary=")
            .nth(1)
            .map(|b| b.trim_start_matches('"'))
            .and_then(|b| b.split(['"', ';', '\n', ' ']).next())
            .filter(|b| !b.is_empty())
            .ok_or_else(|| refuse("mime-multipart", "the Content-Type header has no boundary"))?;
        if !text.to_ascii_lowercase().contains(&format!("--{boundary}")) {
            return Err(refuse(
                "mime-multipart",
                format!("boundary {boundary:?} never appears in the body"),
            ));
        }
        return Ok(());
    }
    Err(refuse(
        "vendor-data-format",
        "must start with a `#cloud-config` line or be a MIME multipart document",
    ))
}

#[cfg(test)]
mod tests;
