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
mod vendor;

pub use allow::{Reading, render_markdown as allow_list_markdown};
pub use domain::{FIRMWARE_CODE, FIRMWARE_VARS, NVRAM_DIR};
pub use tree::{MAX_DEPTH, MAX_ELEMENTS};
pub use vendor::{
    MAX_PARTS as VENDOR_DATA_MAX_PARTS, VendorDataForm, VendorDataPart, VendorDataReading,
    VendorPartType, read_vendor_data,
};

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

/// Checks rendered vendor-data by reading it as the guest's cloud-init will
/// ([`read_vendor_data`]): plain `#cloud-config` YAML or a strict `multipart/mixed`
/// document of shell-script and cloud-config parts; anything cloud-init could read
/// differently from us is refused.
pub fn check_vendor_data(text: &str) -> Result<(), TemplateErrorKind> {
    read_vendor_data(text).map(|_| ())
}

#[cfg(test)]
mod tests;
